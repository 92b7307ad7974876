"""Run a workload in real prefork workers while injecting faults, then check the history.

One run: a broker Redis nobody touches, the lock servers (one, or five for Redlock), two or
more ``celery worker -P prefork`` processes running :mod:`tests.support.faults.app`, jobs
submitted at a steady rate over a few hot keys, and faults from a schedule:

* ``kill-worker``: SIGKILL a worker and its pool (a replacement starts, as a supervisor would);
* ``pause-worker``: SIGSTOP a pool process that is running a job for 1.5 ttl, then SIGCONT;
* ``pause-redis-N``: SIGSTOP N lock servers for half a ttl, then SIGCONT;
* ``restart-redis-N``: N lock servers (Redlock, N a minority) stop, and come back with empty
  data after more than a ttl (the delayed restart the docs require);
* ``outage-redis``: the single Redis stops and comes back empty after more than a ttl
  (a lock lost with its server, under the delayed-restart condition);
* ``pause-redis-long``: the single Redis frozen for longer than a ttl;

and jobs that freeze themselves between their last lease check and their write (a GC pause),
resumed once another execution has written the key with a newer token.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from celery_dlock.testing import RedisServer
from tests.support.faults import checker, history

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Profile:
    name: str
    seconds: float  # how long jobs are submitted and faults injected
    rate: float  # jobs submitted per second
    keys: int
    workers: int
    concurrency: int
    ttl: float
    pause_every: int  # every n-th job freezes before its write
    cycles: int  # how many times the fault schedule repeats


#: Seconds without a newly applied job after which the drain stops waiting: well over the
#: 6 s visibility timeout plus restore and requeue delays (tests/support/faults/app.py).
STALL = 20.0

SHORT = Profile("short", 24.0, 6.0, 3, 2, 2, 2.0, 25, 1)
LONG = Profile("long", 150.0, 8.0, 4, 3, 2, 2.0, 20, 6)

SCHEDULES = {
    "single": ["kill-worker", "pause-worker", "pause-redis-1", "outage-redis", "pause-worker",
               "pause-redis-long", "kill-worker"],
    "redlock5": ["kill-worker", "pause-worker", "pause-redis-1", "restart-redis-1",
                 "pause-redis-2", "restart-redis-2", "kill-worker"],
}  # fmt: skip


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Worker:
    def __init__(self, name: str, env: dict[str, str], directory: Path, concurrency: int) -> None:
        self.name = name
        log = directory / f"{name}.log"
        args = [
            sys.executable, "-m", "celery", "-A", "tests.support.faults.app", "worker",
            "-P", "prefork", "-c", str(concurrency), "-n", f"{name}@faults", "--without-gossip",
            "--without-mingle", "--without-heartbeat", "-l", "WARNING", "--logfile", str(log),
        ]  # fmt: skip
        self.process = subprocess.Popen(
            args, env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, cwd=directory,
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.process.pid

    def children(self) -> list[int]:
        try:
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGCONT)
            os.killpg(self.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGCONT)
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=15)
        self.kill()


class Run:
    """One fault run; :meth:`execute` returns the checker's report."""

    def __init__(self, mode: str, profile: Profile, directory: Path, seed: int = 1) -> None:
        self.mode = mode
        self.profile = profile
        self.directory = directory
        self.random = random.Random(seed)
        self.workers: list[Worker] = []
        self.paused: dict[int, float] = {}  # pool process frozen by a fault -> resume at
        self.resumed_writers: set[tuple[int, float]] = set()  # (pid, when it froze itself)
        self.jobs: list[str] = []
        self.follower = history.Follower(directory)
        self.current: dict[int, dict[str, Any]] = {}  # pool process -> its unfinished start
        self.pausing: list[dict[str, Any]] = []  # self-frozen writers, in order

    def fault(self, kind: str, **fields: Any) -> None:
        # Recorded before the harness acts, never after: a resumed process can report what
        # the resume caused before this process is scheduled again, and the checker measures
        # each loss from a cause at or before it (a CI run saw a loss 4.4 s "after its cause":
        # the resume that caused it was recorded a few ms after the loss).
        history.record(self.directory, "fault", kind=kind, **fields)

    # -- processes ----------------------------------------------------------------------------

    def start_worker(self) -> None:
        name = f"w{len(self.workers) + 1}-{self.mode}"
        self.workers.append(Worker(name, self.env, self.directory, self.profile.concurrency))

    def follow(self) -> None:
        """Take in what the executions wrote since the last look."""
        for e in self.follower.poll():
            if e["event"] == "start":
                self.current[e["pid"]] = e
            elif e["event"] == "end":
                self.current.pop(e["pid"], None)
            elif e["event"] == "pausing":
                self.pausing.append(e)

    def running(self) -> dict[int, dict[str, Any]]:
        """Pool processes in a job right now (started, not ended), by pid."""
        self.follow()
        return dict(self.current)

    # -- faults -------------------------------------------------------------------------------

    def inject(self, kind: str) -> bool:
        """Inject one fault; False when it cannot be now (no pool process in a job to pause),
        so the caller tries again shortly instead of skipping it."""
        p = self.profile
        if kind == "kill-worker":
            busy = set(self.running())
            live = [w for w in self.workers if w.process.poll() is None]
            victims = [w for w in live if busy & set(w.children())] or live
            victim = self.random.choice(victims)
            self.fault(kind, worker=victim.pid)
            victim.kill()
            self.workers.remove(victim)
            self.start_worker()
        elif kind == "pause-worker":
            frozen = set(self.pauses_pending())
            now = time.monotonic()
            candidates = [
                pid
                for pid, entry in self.running().items()
                if pid not in set(self.paused) | frozen and now - entry["t"] < 1.0 and alive(pid)
            ]
            if not candidates:
                return False
            pid = self.random.choice(candidates)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                self.paused[pid] = time.monotonic() + 1.5 * p.ttl
                self.fault(kind, target=pid)
        elif kind.startswith("pause-redis"):
            count = 1 if kind == "pause-redis-long" else int(kind.rsplit("-", 1)[1])
            length = p.ttl + 0.5 if kind == "pause-redis-long" else p.ttl / 2
            nodes = self.random.sample(self.servers, count)
            self.fault(kind, nodes=[n.port for n in nodes])
            for node in nodes:
                node.pause()
            time.sleep(length)  # the fault's own length; jobs go on in the workers meanwhile
            self.fault(f"{kind}-resumed", nodes=[n.port for n in nodes])
            for node in nodes:
                node.resume()
        elif kind.startswith("restart-redis"):
            # Delayed restart, the documented condition: the nodes stay down longer than any
            # lease before they come back empty (tests/faults/test_fault_harness.py shows what an
            # immediate one can do).
            nodes = self.random.sample(self.servers, int(kind.rsplit("-", 1)[1]))
            self.fault(kind, nodes=[n.port for n in nodes])
            for node in nodes:
                node.stop()
            time.sleep(p.ttl + 0.5)
            self.fault(f"{kind}-back", nodes=[n.port for n in nodes])
            for node in nodes:
                node.restart(wipe=True)
        elif kind == "outage-redis":
            (node,) = self.servers
            self.fault(kind, nodes=[node.port])
            node.stop()
            time.sleep(p.ttl + 0.5)  # a delayed restart: longer than any lease
            self.fault("outage-redis-back", nodes=[node.port])
            node.restart(wipe=True)
        else:
            raise ValueError(f"unknown fault {kind!r}")
        return True

    def tend_pauses(self, writes: list[dict[str, Any]]) -> None:
        """Resume frozen pool processes when their time has come."""
        now = time.monotonic()
        for pid, until in list(self.paused.items()):
            if now >= until:
                self.fault("resume-worker", target=pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                del self.paused[pid]
        # Self-frozen writers: resume once a newer token was applied to their key, so their
        # late write meets the fence (or after 3 ttl, whatever happened).
        self.follow()
        for e in self.pausing:
            if (e["pid"], e["t"]) in self.resumed_writers:
                continue
            newer = any(
                w["key"] == e["key"] and int(w["token"]) > int(e["token"]) and
                w["outcome"] == "applied" for w in writes
            )  # fmt: skip
            if newer or now - e["t"] > 3 * self.profile.ttl:
                self.fault("resume-paused", target=e["pid"], newer=newer)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(e["pid"], signal.SIGCONT)
                self.resumed_writers.add((e["pid"], e["t"]))

    # -- the run ------------------------------------------------------------------------------

    def writes(self) -> list[dict[str, Any]]:
        """The store's log of write attempts so far (read incrementally)."""
        seen = self.__dict__.setdefault("_writes", [])
        seen.extend(json.loads(raw) for raw in self.store.lrange("writes", len(seen), -1))
        return list(seen)

    def execute(self) -> checker.Report:
        p = self.profile
        count = 5 if self.mode == "redlock5" else 1
        with contextlib.ExitStack() as stack:
            broker = stack.enter_context(RedisServer())
            self.servers = [stack.enter_context(RedisServer()) for _ in range(count)]
            base = broker.url.rsplit("/", 1)[0]
            self.env = {
                "FAULTS_BROKER": base,
                "FAULTS_LOCK_URLS": ",".join(s.url for s in self.servers),
                "FAULTS_DIR": str(self.directory),
                "FAULTS_TTL": str(p.ttl),
            }
            # This process only publishes and pings: an app of its own per run, so no
            # connection pool outlives the broker of an earlier run.
            driver = Celery("faults-driver", broker=f"{base}/0", backend=f"{base}/1")
            stack.callback(driver.close)
            self.store = redis.Redis.from_url(f"{base}/2")
            stack.callback(self.store.close)
            for _ in range(p.workers):
                self.start_worker()
            stack.callback(lambda: [w.stop() for w in self.workers])
            stack.callback(self.resume_everything)
            self.wait_ready(driver)
            self.drive(driver)
            (self.directory / "jobs.json").write_text(json.dumps(self.jobs))
            self.dump_broker(base)
            with (self.directory / "writes.jsonl").open("w") as out:
                for w in self.writes():
                    out.write(json.dumps(w) + "\n")
        return checker.check_directory(self.directory, interval=p.ttl / 3, margin=1.0)

    def dump_broker(self, base: str) -> None:
        """Where the messages of jobs never applied are now (for the report on lost jobs)."""
        applied = {raw.decode() for raw in self.store.smembers("applied")}
        missing = [j for j in self.jobs if j not in applied]
        client = redis.Redis.from_url(f"{base}/0")
        try:
            places: dict[str, list[str]] = {j: [] for j in missing}
            for name, raw in client.hgetall("unacked").items():
                for j in missing:
                    if f'"{j}"'.encode() in raw:
                        places[j].append(f"unacked {name.decode()}")
            for raw in client.lrange("celery", 0, -1):
                for j in missing:
                    if f'"{j}"'.encode() in raw:
                        places[j].append("queue")
        finally:
            client.close()
        (self.directory / "broker.json").write_text(json.dumps(places, indent=1))

    def resume_everything(self) -> None:
        for pid in [*self.paused, *self.pauses_pending()]:
            self.fault("resume-at-end", target=pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def pauses_pending(self) -> list[int]:
        """Pool processes that froze themselves before a write and are not resumed yet."""
        self.follow()
        return [e["pid"] for e in self.pausing if (e["pid"], e["t"]) not in self.resumed_writers]

    def wait_ready(self, app: Any, timeout: float = 60) -> None:
        names = {f"{w.name}@faults" for w in self.workers}
        deadline = time.monotonic() + timeout
        while True:
            replies = app.control.ping(destination=sorted(names), timeout=0.5) or []
            if names <= {n for r in replies for n in r}:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready: {names}")

    def drive(self, driver: Celery) -> None:
        p = self.profile
        schedule = SCHEDULES[self.mode] * p.cycles
        spacing = p.seconds / (len(schedule) + 1)
        started = time.monotonic()
        next_fault = 0
        submitted = 0
        while time.monotonic() - started < p.seconds:
            elapsed = time.monotonic() - started
            while submitted < elapsed * p.rate:
                self.submit(driver, submitted)
                submitted += 1
            due = next_fault < len(schedule) and elapsed >= spacing * (next_fault + 1)
            if due and self.inject(schedule[next_fault]):
                next_fault += 1
            self.tend_pauses(self.writes())
            time.sleep(0.05)
        # Let everything finish: each job applied once, nothing frozen. Stop early once nothing
        # has moved for longer than a lost message takes to come back (visibility timeout,
        # restore, requeue backoff), so a job that is really gone costs seconds, not minutes.
        deadline = time.monotonic() + 90
        progress, moved = -1, time.monotonic()
        while time.monotonic() < deadline:
            self.tend_pauses(self.writes())
            applied = self.store.scard("applied")
            if applied >= len(self.jobs) and not self.paused and not self.pauses_pending():
                break
            if applied != progress or self.paused:
                progress, moved = applied, time.monotonic()
            elif time.monotonic() - moved > STALL:
                break
            time.sleep(0.1)

    def submit(self, driver: Celery, n: int) -> None:
        job = f"job-{n}"
        key = f"hot-{self.random.randrange(self.profile.keys)}"
        secs = self.random.uniform(0.05, 0.3)
        every = self.profile.pause_every
        name = "paused_job" if every and n % every == every - 1 else "job"
        history.record(self.directory, "published", job=job)
        driver.send_task(f"tests.support.faults.app.{name}", (job, key, secs), task_id=job)
        self.jobs.append(job)


def run(
    mode: str, profile: Profile, directory: Path | None = None, seed: int = 1
) -> checker.Report:
    folder = directory or Path(tempfile.mkdtemp(prefix=f"dlock-faults-{mode}-"))
    return Run(mode, profile, folder, seed).execute()
