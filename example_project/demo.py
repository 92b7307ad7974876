"""The demo: the same burst of jobs through plain Celery tasks, then through celery_dlock.

    python -m example_project                  # embedded Redis from the bundled binary
    python -m example_project --redlock        # five embedded masters, Redlock
    python -m example_project --redis-url redis://127.0.0.1:6379/0 [--redis-url ...]
    python -m example_project --short --json   # the short run, one JSON object on stdout
    python -m example_project --timeline runs.svg   # also draw the per-key timeline

It starts Redis, the rate-limited external API, two Celery workers (prefork, concurrency 2)
and beat, then runs two passes of the same workload: replication scheduled every second by
beat (a run takes two), and a burst of collection jobs with duplicates over six entities. In
the celery_dlock pass it also SIGKILLs the worker running replication (another takes over
after the lock's ttl) and pauses a collector between its lease check and its write for longer
than the ttl (a stand-in for a GC pause), so the fence refuses its late write.

Exit status 0 only if, in the celery_dlock pass, no key ever ran twice at once and no stale
write got through. Ctrl-C (or SIGTERM) stops every process the demo started, then exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from example_project import metadata, processes, stopping, timeline
from example_project.api import ExternalAPI
from example_project.journal import Journal
from example_project.processes import Process, wait_until

SOURCES = ("crm", "erp")
ENTITIES = ("acme", "globex", "initech")
LATE = ("crm", "acme", "late")  # the job the celery_dlock pass pauses mid-write
REPLICATION_TTL = 3.0  # example_project.tasks.replicate's lock_ttl


@dataclass
class Pass:
    name: str
    t0: float = 0.0
    killed: dict[int, float] = field(default_factory=dict)  # worker pid -> when it was killed
    takeover: float | None = None
    paused_pid: int | None = None
    report: dict[str, Any] = field(default_factory=dict)
    spans: list[timeline.Span] = field(default_factory=list)


class Demo:
    def __init__(self, args: argparse.Namespace, out: Any) -> None:
        self.args = args
        self.out = out
        self.started = time.monotonic()
        self.windows = ["w1", "w2"] if args.short else ["w1", "w2", "w3"]
        self.stack = contextlib.ExitStack()
        self.directory = Path(tempfile.mkdtemp(prefix="dlock-demo-"))
        self.workers: list[Process] = []
        self.env: dict[str, str] = {}

    def tidy(self, keep: bool) -> None:
        """Remove the run's directory once every process that wrote to it is stopped, or say
        where it is: a failed run's tables, journals and worker logs are what explains it.
        An unexpected error skips this (the traceback goes first) and keeps the directory."""
        if keep:
            self.say(f"tables, journals and logs kept in {self.directory}")
        else:
            shutil.rmtree(self.directory, ignore_errors=True)

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:5.1f}s] {message}", file=self.out, flush=True)

    # -- set-up -------------------------------------------------------------------------------

    def redis_urls(self) -> list[str]:
        if self.args.redis_url:
            return list(self.args.redis_url)
        from celery_dlock.testing import redis_servers

        count = 5 if self.args.redlock else 1
        servers = self.stack.enter_context(redis_servers(count))
        self.say(f"started {count} embedded redis-server: ports {[s.port for s in servers]}")
        stopping.pause_point("redis")
        return [s.url for s in servers]

    def setup(self) -> None:
        stopping.check()  # a signal before the demo got here (during its imports, say)
        urls = self.redis_urls()
        api = self.stack.enter_context(ExternalAPI(rate=8.0, burst=2, latency=0.15))
        self.api = api
        self.say(f"external API (8 calls/s per entity, then 429) on {api.url}")
        run = uuid.uuid4().hex[:8]
        self.env = {
            "EXAMPLE_BROKER_URL": urls[0],
            "EXAMPLE_DLOCK_URLS": ",".join(urls),
            "EXAMPLE_PREFIX": f"example-{run}",
            "EXAMPLE_QUEUE": f"example-{run}",
            "EXAMPLE_DIR": str(self.directory),
            "EXAMPLE_API_URL": api.url,
            "EXAMPLE_REPLICATION_POLICY": self.args.replication,
        }
        os.environ.update(self.env)  # this process sends the tasks with the same app
        for name in ("plain", "dlock"):
            (self.directory / name).mkdir()
            metadata.create(self.directory / name / "metadata.db")
            Journal(self.directory / name / "journal.db").create()
        from example_project.celery_app import app

        self.app = app
        self.workers = [self.start_worker(f"w{i}") for i in (1, 2)]
        self.wait_workers(self.workers)
        mode = f"Redlock over {len(urls)} masters" if len(urls) > 1 else "one Redis"
        self.say(f"2 workers (prefork, concurrency 2) up; locks on {mode}")
        self.say(f"tables, journals and logs in {self.directory} (removed at the end; --keep)")

    def start_worker(self, name: str) -> Process:
        proc = processes.worker(name, self.env, self.directory)
        self.stack.callback(proc.stop)
        return proc.start()

    def wait_workers(self, workers: list[Process], timeout: float = 60) -> None:
        names = {f"{w.name}@{socket.gethostname()}" for w in workers}

        def ready() -> bool:
            for w in workers:
                if not w.alive:
                    raise RuntimeError(f"worker {w.name} exited; its log:\n{w.log()}")
            replies = self.app.control.ping(destination=sorted(names), timeout=0.5) or []
            return names <= {name for reply in replies for name in reply}

        wait_until(ready, timeout, "the workers to answer a ping")

    # -- the workload -------------------------------------------------------------------------

    def task(self, name: str, run: Pass) -> Any:
        from example_project import tasks

        return getattr(tasks, name if run.name == "dlock" else f"{name}_plain")

    def send_burst(self, run: Pass) -> None:
        collect = self.task("collect", run)
        sent = 0
        for window in self.windows:
            for source in SOURCES:
                for entity in ENTITIES:
                    # Every job twice: a client retried, a user double-clicked.
                    for _copy in range(2):
                        collect.delay(source, entity, window)
                        sent += 1
            stopping.sleep(0.3)
        windows = len(self.windows)
        self.say(f"{run.name}: sent {sent} collection jobs ({windows} windows x 6 entities, twice)")

    def journal(self, run: Pass) -> Journal:
        return Journal(self.directory / run.name / "journal.db")

    def table(self, run: Pass) -> Any:
        return metadata.connect(self.directory / run.name / "metadata.db")

    def done_windows(self, run: Pass) -> int:
        with contextlib.closing(self.table(run)) as conn:
            (n,) = conn.execute(
                "SELECT COUNT(*) FROM (SELECT DISTINCT source, entity, window FROM jobs "
                "WHERE status = 'done' AND window != ?)",
                (LATE[2],),
            ).fetchone()
        return int(n)

    def in_flight(self, run: Pass, task: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in self.journal(run).executions()
            if e["ended"] is None
            and e["started"] >= run.t0
            and e["worker"] not in run.killed
            and e["pid"] != run.paused_pid
            and (task is None or e["task"] == task)
        ]

    def beat(self, run: Pass) -> Process:
        env = {**self.env, "EXAMPLE_BEAT": run.name}
        proc = processes.beat(f"beat-{run.name}", env, self.directory)
        self.stack.callback(proc.stop)
        return proc.start()

    def run_pass(self, run: Pass) -> None:
        run.t0 = time.time()
        self.api.reset()
        what = "plain Celery tasks" if run.name == "plain" else "the same tasks as SingletonTasks"
        self.say(f"--- pass '{run.name}': {what}")
        beat = self.beat(run)
        self.send_burst(run)
        expected = len(self.windows) * len(SOURCES) * len(ENTITIES)
        wait_until(lambda: self.done_windows(run) >= expected, 60, "the burst to be collected")
        self.say(f"{run.name}: all {expected} windows collected")
        if run.name == "dlock":
            self.crash_replication(run)
            self.pause_collector(run)
        else:
            collect = self.task("collect", run)
            collect.delay(*LATE)
            collect.delay(*LATE)
            # Let beat's replication runs pile up for as long as the dlock pass's faults take.
            wait_until(lambda: time.time() - run.t0 > 8, 15, "replication to run a while")
        beat.stop()
        wait_until(lambda: not self.in_flight(run), 30, "running tasks to finish")
        self.collect_report(run)

    # -- faults (celery_dlock pass) ----------------------------------------------------------

    def crash_replication(self, run: Pass) -> None:
        """SIGKILL the worker running replication; time how long until another runs it."""

        def victim() -> dict[str, Any] | None:
            running = self.in_flight(run)
            for e in running:
                busy = [o for o in running if o["worker"] == e["worker"] and o is not e]
                if e["task"] == "replicate" and not busy:
                    return e
            return None

        wait_until(lambda: victim() is not None, 20, "replication on an otherwise idle worker")
        execution = victim()
        assert execution is not None
        worker = next(w for w in self.workers if w.pid == execution["worker"])
        worker.kill()
        run.killed[worker.pid] = killed_at = time.time()
        self.say(
            f"dlock: SIGKILLed worker {worker.name} (pid {worker.pid}) while it ran "
            f"replication (fencing token {execution['token']})"
        )
        self.workers.remove(worker)
        # A supervisor would start it again; so does the demo.
        self.workers.append(self.start_worker(f"w{len(run.killed) + 2}"))

        def took_over() -> float | None:
            executions = self.journal(run).executions()
            later = [e["started"] for e in executions if e["task"] == "replicate"]
            later = [t for t in later if t > killed_at]
            return min(later) - killed_at if later else None

        wait_until(lambda: took_over() is not None, REPLICATION_TTL + 15, "replication to resume")
        run.takeover = took_over()
        self.say(
            f"dlock: replication ran again {run.takeover:.2f} s after the crash "
            f"(lock ttl {REPLICATION_TTL:.0f} s, beat every 1 s)"
        )

    def pause_collector(self, run: Pass) -> None:
        """Freeze a collector between its lease check and its write for longer than the ttl."""
        collect = self.task("collect", run)
        collect.delay(*LATE, pause=True)
        book = self.journal(run)
        wait_until(lambda: bool(book.events("pausing")), 20, "the collector to reach its write")
        paused = book.events("pausing")[0]
        run.paused_pid = paused["pid"]
        self.say(f"dlock: collector pid {paused['pid']} paused right before its write (SIGSTOP)")
        collect.delay(*LATE)  # the job again: its lease expires, so this copy takes it over

        def takeover_written() -> bool:
            with contextlib.closing(self.table(run)) as conn:
                row = conn.execute(
                    "SELECT attempts FROM jobs WHERE window = ? AND status = 'done'", (LATE[2],)
                ).fetchone()
            return row is not None

        wait_until(takeover_written, 30, "another collector to take the job over")
        self.say("dlock: another collector took the job over (attempt 2) and wrote it")
        os.kill(paused["pid"], signal.SIGCONT)

        def resumed_and_ended() -> bool:
            return any(
                e["ended"] is not None and self.paused_at(run, e) is not None
                for e in book.executions()
            )

        wait_until(resumed_and_ended, 20, "the paused collector to resume and end")
        refused = "refused by the fence" if self.stale(run)[1] else "not attempted"
        self.say(f"dlock: resumed it; its write with the old token was {refused}")

    def paused_at(self, run: Pass, execution: dict[str, Any]) -> float | None:
        """When ``execution`` froze itself before its write, or None if it did not."""
        for event in self.journal(run).events("pausing"):
            if (
                event["pid"] == execution["pid"]
                and event["key"] == execution["key"]
                and execution["started"] <= event["at"]
                and (execution["ended"] is None or execution["ended"] >= event["at"])
            ):
                return float(event["at"])
        return None

    def stale(self, run: Pass) -> tuple[int, int]:
        with contextlib.closing(self.table(run)) as conn:
            counts = metadata.counts(conn)
        return counts.stale_accepted, counts.stale_rejected

    # -- the report ---------------------------------------------------------------------------

    def collect_report(self, run: Pass) -> None:
        book = self.journal(run)
        executions = [e for e in book.executions() if e["started"] >= run.t0]
        paused = {id(e): at for e in executions if (at := self.paused_at(run, e)) is not None}
        for e in executions:
            end, outcome = e["ended"], e["outcome"] or "?"
            if e["worker"] in run.killed and end is None:
                end, outcome = run.killed[e["worker"]], "killed"
            elif id(e) in paused:
                # From the pause on it did nothing but the refused write: it held the key
                # until it was frozen, not after.
                end, outcome = paused[id(e)], "paused"
            if end is None:
                continue
            span = timeline.Span(
                e["key"], e["started"] - run.t0, end - run.t0, f"pid {e['pid']}", outcome
            )
            run.spans.append(span)
        with contextlib.closing(self.table(run)) as conn:
            writes = metadata.counts(conn)
        api = self.api.stats()
        per_key = timeline.overlaps(run.spans)
        run.report = {
            "executions": len(executions),
            "replication_runs": sum(e["task"] == "replicate" for e in executions),
            "collection_runs": sum(e["task"] == "collect" for e in executions),
            "dropped": len(book.events("drop")),
            "requeued": len(book.events("requeue")),
            "leases_lost": len(book.events("lost")),
            "max_concurrent_per_key": max(per_key.values(), default=0),
            "keys_run_concurrently": sorted(k for k, n in per_key.items() if n > 1),
            "api_calls": api["calls"],
            "max_concurrent_api_calls_per_entity": api["max_concurrent"],
            "duplicate_api_calls": api["duplicate_calls"],
            "rate_limited_429": api["rate_limited"],
            "duplicate_jobs": writes.duplicate_jobs,
            "stale_writes_accepted": writes.stale_accepted,
            "stale_writes_rejected": writes.stale_rejected,
        }
        most = run.report["max_concurrent_per_key"]
        self.say(f"{run.name}: {len(executions)} executions, at most {most} at once for one key")


ROWS = [
    ("executions (replication + collection)", "executions"),
    ("  replication runs", "replication_runs"),
    ("  collection runs", "collection_runs"),
    ("duplicates dropped", "dropped"),
    ("duplicates requeued", "requeued"),
    ("leases reported lost", "leases_lost"),
    ("max concurrent runs of one key", "max_concurrent_per_key"),
    ("external API calls", "api_calls"),
    ("max concurrent API calls, one entity", "max_concurrent_api_calls_per_entity"),
    ("API calls overlapping another (same entity)", "duplicate_api_calls"),
    ("429 Too Many Requests", "rate_limited_429"),
    ("jobs created twice for one window", "duplicate_jobs"),
    ("stale writes accepted", "stale_writes_accepted"),
    ("stale writes rejected by the fence", "stale_writes_rejected"),
]


def table(passes: list[Pass], takeover: float | None) -> str:
    lines = [f"{'':46} {'plain':>8} {'dlock':>8}"]
    for label, name in ROWS:
        lines.append(f"{label:46} " + " ".join(f"{p.report[name]:>8}" for p in passes))
    shown = "-" if takeover is None else f"{takeover:.2f} s"
    lines.append(f"{'takeover after SIGKILL of the replication worker':46} {'':>8} {shown:>8}")
    return "\n".join(lines)


def verdict(passes: dict[str, Pass]) -> tuple[bool, list[str]]:
    dlock = passes["dlock"].report
    problems = []
    if dlock["max_concurrent_per_key"] > 1:
        keys = dlock["keys_run_concurrently"]
        problems.append(f"keys ran twice at once with celery_dlock: {keys}")
    if dlock["stale_writes_accepted"]:
        problems.append(f"{dlock['stale_writes_accepted']} stale writes got through")
    return not problems, problems


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m example_project",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--redis-url",
        action="append",
        metavar="URL",
        help="use this Redis, not an embedded one (repeat for Redlock; the first is the broker)",
    )
    add("--redlock", action="store_true", help="five embedded Redis masters")
    add("--short", action="store_true", help="a smaller burst (for tests)")
    add("--json", action="store_true", help="print one JSON object on stdout")
    add("--timeline", metavar="FILE", type=Path, help="draw the per-key timeline (.svg, .html)")
    add("--replication", choices=("drop", "wait"), default="drop",
        help="what a worker that receives replication while it runs does")  # fmt: skip
    add("--keep", action="store_true",
        help="keep the tables, journals and logs (a failed demo always keeps them)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.redis_url and len(args.redis_url) == 2:
        parser.error("--redis-url given twice: give one URL, or three or more for Redlock")
    if args.timeline and args.timeline.suffix not in (".svg", ".html"):
        parser.error(f"--timeline {args.timeline}: the file name must end in .svg or .html")
    return args


def report(args: argparse.Namespace, passes: dict[str, Pass], out: Any) -> int:
    """Print the comparison (or the JSON object); the exit status: 0 if the verdict is ok."""
    ok, problems = verdict(passes)
    takeover = passes["dlock"].takeover
    if args.timeline:
        timeline.write_picture({p.name: p.spans for p in passes.values()}, args.timeline)
    if args.json:
        result = {name: p.report for name, p in passes.items()}
        print(json.dumps({**result, "takeover_seconds": takeover, "ok": ok, "problems": problems}))
    else:
        print("\nExecutions per key over time:\n", file=out)
        print(timeline.render_text({p.name: p.spans for p in passes.values()}), file=out)
        print("\n" + table(list(passes.values()), takeover), file=out)
        if args.timeline:
            print(f"\ntimeline picture: {args.timeline}", file=out)
        if ok:
            print(
                "\nOK: with celery_dlock no key ran twice at once, no stale write got through",
                file=out,
            )
        else:
            print("\nFAILED: " + "; ".join(problems), file=out)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = sys.stderr if args.json else sys.stdout
    demo = Demo(args, out)
    passes = {"plain": Pass("plain"), "dlock": Pass("dlock")}
    with stopping.stop_signals():
        try:
            with demo.stack:  # on every way out it stops what the demo started, in reverse
                demo.setup()
                for run in passes.values():
                    demo.run_pass(run)
                stopping.check()
                demo.say("stopping workers")
        except stopping.Interrupted:
            pass
        except Exception as exc:
            if stopping.requested() is None:
                raise
            # Failed because of the stop: a terminal's Ctrl-C also reaches the embedded
            # redis-server, which is in the demo's process group.
            demo.say(f"while stopping: {type(exc).__name__}: {exc}")
        status = report(args, passes, out) if stopping.requested() is None else 130
        demo.tidy(keep=args.keep or status == 1)
        if stopping.requested() is not None:  # also one that came during the stop or the report
            demo.say("interrupted: every process the demo started is stopped")
            return 130
        return status
