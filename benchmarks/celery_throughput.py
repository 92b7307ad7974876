"""Per-task overhead in real Celery workers: plain tasks against SingletonTask and its peers.

Starts seven throwaway redis-server processes on 127.0.0.1: one holds the broker (db 0), the
result backend (db 1) and a small journal (db 2); one holds the locks of the single-Redis rows
and of the peers; five are the Redlock masters. Every row runs in its own fresh ``celery
worker -P prefork -c CONCURRENCY`` subprocess with the same settings (app:
``benchmarks/_throughput_app.py``, configured from the environment; only ``dlock_urls``
differs between workers: one URL, or five for ``dlock-redlock5``). Celery's defaults
otherwise (prefetch multiplier 4, early acks), log level WARNING, no events.

Rows (each task returns its argument and does nothing else):

* ``plain``             a plain ``Task``
* ``floor``             a plain ``Task`` whose body also makes one ``SET NX PX`` round trip to the
                        lock Redis: the least any lock taken in the worker costs
* ``floor-release``     ``floor`` plus a ``DEL`` of the key at the end, its reply read before the
                        next command: the least an execution-time lock that frees its key costs
* ``floor-fenced``      ``SET NX PX`` and a fence ``INCR`` in one pipeline, and a
                        compare-and-delete script sent at the end without waiting: the least a
                        lock with our guarantees (fencing, owner-checked release) must do
* ``dlock``             ``SingletonTask``, lock taken in the worker (``lock_on="execute"``)
* ``dlock-redlock5``    the same with ``dlock_urls`` = five masters
* ``dlock-enqueue``     ``SingletonTask(lock_on="enqueue")``, single Redis
* ``celery-singleton``  celery-singleton's ``Singleton`` base
* ``celery-once``       celery-once's ``QueueOnce`` base

**Throughput**, per row and round: start the worker consuming only a queue named ``idle``;
send it ``--warmup`` tasks of the row there and wait for their results (pool children up,
connections open, scripts loaded). Then, from this process, call ``task.delay(i)`` ``--tasks``
times with distinct arguments (distinct keys) into the default queue, which nobody consumes
yet: **enqueue cost** = that time / tasks (wall clock; this process's CPU time is recorded
too). Then make the worker consume the default queue (``add_consumer``, see :func:`consume`)
and poll the backend's key count (``DBSIZE`` every 20 ms, with a deadline) until every result
is stored: **throughput** = tasks / (time from sending ``add_consumer`` to the latest
``date_done`` among the results). Every result is checked (SUCCESS, its argument back). Rows
are interleaved over ``--rounds`` rounds (reversed order every other round); the figures are
medians over rounds. Per task, the worker's CPU time (main process + pool children, from
``/proc``) and the redis-servers' (``INFO cpu``) are recorded too.

**Storm**, once per library: ``--tasks`` calls of ``task.delay(0, secs=S, count=True)`` with
identical arguments (one key), enqueued before the worker consumes, as above. The body counts
itself in the journal (``INCR``) and sleeps ``S`` (``--storm-sleep``; by default 2 ms per
call, 4 s for 2,000, so that the first execution still holds the key when the last duplicate
is handled). Reported: what the calls did (messages published; duplicates answered at enqueue
with the queued task's ``AsyncResult``; calls refused with an exception), how many bodies
ran, and the time, from ``add_consumer``, until the quick messages were all handled
(``quick``: SingletonTask's dropped duplicates) and until everything was (``drained``).
``SingletonTask`` (``on_duplicate="drop"``) publishes every duplicate and drops it in the
worker; ``lock_on="enqueue"`` and celery-singleton answer duplicates at enqueue with the
queued task's result; celery-once raises ``AlreadyQueued`` at enqueue.

Plain Celery cannot deduplicate, and 2,000 sleeping bodies would take 2,000 x S / CONCURRENCY
seconds. Its row is the load that a working deduplication leaves: 2,000 messages of which the
first sleeps ``S`` and the other 1,999 are empty (``secs=0``, not counted in the journal) and
end at once (``quick``). So SingletonTask's ``quick`` compares a dropped duplicate with an
empty task on the same pool capacity (one process sleeps, the others handle the rest).

CPU placement (``--pin``): ``split`` (default) keeps this process on the first CPU and the
redis-servers on the others; the worker and its pool may use every CPU. ``none`` leaves all
of it to the scheduler. See benchmarks/README.md for why placement matters on a small VM.

Run: ``.venv/bin/python benchmarks/celery_throughput.py [--tasks N] [--concurrency C] [--json]``
(``--report FILE`` prints the tables of a saved ``--json`` result).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from _common import machine, pin

from celery_dlock.testing import redis_servers

HERE = Path(__file__).resolve().parent
APP_MODULE = "_throughput_app"
DEFAULT_QUEUE = "celery"
IDLE_QUEUE = "idle"
POLL_S = 0.02  # interval of the completion polls (each bounded by a deadline)
STORM_SLEEP_PER_CALL = 0.002  # default storm body: this many seconds per call, at least 0.2
READY_KEY = "bench:ready"  # as in _throughput_app (imported only once the env is set)
EXECUTED_KEY = "bench:executed"

#: (row, task name, lock URLs: "single" or "redlock")
ROWS: tuple[tuple[str, str, str], ...] = (
    ("plain", "bench.plain", "single"),
    ("floor", "bench.floor", "single"),
    ("floor-release", "bench.floor_release", "single"),
    ("floor-fenced", "bench.floor_fenced", "single"),
    ("dlock", "bench.dlock", "single"),
    ("dlock-redlock5", "bench.dlock", "redlock"),
    ("dlock-enqueue", "bench.dlock_enqueue", "single"),
    ("celery-singleton", "bench.singleton", "single"),
    ("celery-once", "bench.once", "single"),
)
STORM_ROWS = ("plain", "dlock", "dlock-enqueue", "celery-singleton", "celery-once")

#: (row, figure, base row, target ratio to the base or None, "min"/"max": the side it bounds)
RATIOS: tuple[tuple[str, str, str, float | None, str], ...] = (
    ("dlock", "tasks_per_s", "plain", 0.92, "min"),
    ("dlock", "enqueue_us", "plain", 1.05, "max"),
    ("dlock-enqueue", "enqueue_us", "plain", 1.25, "max"),
    ("dlock", "worker_cpu_us", "plain", None, ""),
    ("floor", "tasks_per_s", "plain", None, ""),
    ("floor", "worker_cpu_us", "plain", None, ""),
    # What the lock costs beyond the one round trip no execution-time lock can avoid.
    ("dlock", "tasks_per_s", "floor", None, ""),
    ("floor-release", "tasks_per_s", "plain", None, ""),
    ("floor-release", "worker_cpu_us", "plain", None, ""),
    # ... and beyond the two commands (take, give back) an execution-time lock needs.
    ("dlock", "tasks_per_s", "floor-release", None, ""),
    # ... and beyond what a lock with our guarantees must send (issue 34's target).
    ("dlock", "tasks_per_s", "floor-fenced", 0.97, "min"),
    ("dlock", "total_cpu_us", "floor-fenced", None, ""),
    ("dlock", "total_cpu_us", "celery-singleton", 1.0, "max"),
    ("dlock", "total_cpu_us", "celery-once", 1.0, "max"),
    ("dlock-redlock5", "tasks_per_s", "plain", None, ""),
    ("dlock-redlock5", "enqueue_us", "plain", None, ""),
    ("dlock-redlock5", "worker_cpu_us", "plain", None, ""),
    ("dlock-enqueue", "tasks_per_s", "plain", None, ""),
    ("celery-singleton", "tasks_per_s", "plain", None, ""),
    ("celery-singleton", "enqueue_us", "plain", None, ""),
    ("celery-once", "tasks_per_s", "plain", None, ""),
    ("celery-once", "enqueue_us", "plain", None, ""),
)


# -- processes ---------------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """CPU time (user + system) of one process, from /proc; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


class Worker:
    """One ``celery worker`` subprocess (a new session: its pool children are its group)."""

    def __init__(self, env: dict[str, str], name: str, concurrency: int) -> None:
        self.env = env
        self.hostname = f"{name}@bench"
        self.concurrency = concurrency
        self.logdir = Path(tempfile.mkdtemp(prefix="bench-worker-"))
        self.logfile = self.logdir / "worker.log"
        self.process: subprocess.Popen[bytes] | None = None
        #: Put before the command (``worker_cpu.py --callgrind``: valgrind and its options).
        self.prefix: list[str] = []
        self.pool = "prefork"

    def start(self, journal: redis.Redis, timeout: float = 60.0) -> None:
        args = [
            *self.prefix, sys.executable, "-m", "celery", "-A", APP_MODULE, "worker",
            "-P", self.pool, "-c", str(self.concurrency), "-n", self.hostname,
            "-Q", IDLE_QUEUE, "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-l", "WARNING", "--logfile", str(self.logfile),
        ]  # fmt: skip
        path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, **self.env, "PYTHONPATH": path}
        with self.logfile.open("ab") as out:  # the banner and anything printed
            self.process = subprocess.Popen(
                args, env=env, cwd=HERE, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:  # worker_ready pushes the hostname; BLPOP blocks until it does
            left = deadline - time.monotonic()
            if self.process.poll() is not None or left <= 0:
                log = self.log()
                self.stop()
                raise RuntimeError(f"worker {self.hostname} did not start; log:\n{log}")
            popped = journal.blpop([READY_KEY], timeout=min(1.0, left))
            if popped is not None and popped[1] in (self.hostname, self.hostname.encode()):
                return

    def cpu_s(self) -> float:
        """CPU time of the worker's main process and its pool children so far."""
        return sum(self.cpu_split_s())

    def cpu_split_s(self) -> tuple[float, float]:
        """CPU time so far of the worker's main process, and of its pool children together."""
        assert self.process is not None
        pid = self.process.pid
        return proc_cpu_s(pid), sum(proc_cpu_s(c) for c in children(pid))

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def stop(self) -> None:
        """Warm shutdown, then kill whatever is left of the group; the log goes too."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None
        shutil.rmtree(self.logdir, ignore_errors=True)


def machine_cpu_s() -> tuple[float, float]:
    """CPU time all CPUs spent busy (user, nice, system, irq, softirq), and stolen by the
    hypervisor, since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq) / hz, steal / hz


def servers_cpu_s(clients: Sequence[redis.Redis]) -> float:
    total = 0.0
    for c in clients:
        info = c.info("cpu")
        total += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    return total


# -- one measurement ----------------------------------------------------------------------------


@dataclass
class Env:
    """The app, the servers' clients and the worker settings."""

    app: Any
    broker: redis.Redis
    backend: redis.Redis
    journal: redis.Redis
    lock_clients: list[redis.Redis]  # single lock server first, then the five masters
    server_clients: list[redis.Redis]  # every server, for INFO cpu
    worker_env: dict[str, dict[str, str]]  # by "single" / "redlock"
    worker_cpus: str
    concurrency: int
    warmup: int
    timeout: float
    serial: int = 0

    def fresh(self) -> None:
        """Empty queues, results, journal and locks: every measurement starts alike."""
        for c in (self.broker, self.backend, self.journal, *self.lock_clients):
            c.flushdb()

    def worker(self, row: str, locks: str) -> Worker:
        self.serial += 1
        env = {**self.worker_env[locks], "BENCH_WORKER_CPUS": self.worker_cpus}
        w = Worker(env, f"{row}-{self.serial}", self.concurrency)
        w.start(self.journal)
        return w


def wait_results(backend: redis.Redis, count: int, timeout: float, what: str) -> None:
    """Poll the backend's key count (one result key per task) until ``count``, or fail."""
    deadline = time.monotonic() + timeout
    while backend.dbsize() < count:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"timed out after {timeout} s: {backend.dbsize()} of {count} results ({what})"
            )
        time.sleep(POLL_S)


def read_results(backend: redis.Redis, ids: Sequence[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(0, len(ids), 500):
        keys = [f"celery-task-meta-{t}" for t in ids[i : i + 500]]
        out += [json.loads(raw) if raw else {} for raw in backend.mget(keys)]
    return out


def done_at(meta: dict[str, Any]) -> float:
    """When the worker stored the result (``date_done``, UTC), as a Unix time."""
    return datetime.fromisoformat(meta["date_done"]).timestamp()


def warm_up(env: Env, task: Any, base: int) -> None:
    """Tasks through the ``idle`` queue the worker consumes, waited for."""
    results = [task.apply_async((base + i,), queue=IDLE_QUEUE) for i in range(env.warmup)]
    for r in results:
        r.get(timeout=env.timeout)
    for r in results:
        r.forget()


def consume(env: Env, worker: Worker, queued: int) -> float:
    """Make the worker consume the default queue; returns the wall time the command was sent.

    ``add_consumer`` adds the queue, but the worker's pending ``BRPOP`` (on ``idle`` only)
    would run on until its 1 s server-side timeout before the next one includes the new
    queue: we end it early with ``CLIENT UNBLOCK`` (the worker sees an ordinary timeout), and
    repeat that, with a deadline, until the worker has taken a message.
    """
    sent = time.time()
    replies = env.app.control.add_consumer(
        DEFAULT_QUEUE, destination=[worker.hostname], reply=True, limit=1, timeout=10
    )
    if not replies:
        raise RuntimeError(f"{worker.hostname} did not acknowledge add_consumer")
    deadline = time.monotonic() + 10
    while env.broker.llen(DEFAULT_QUEUE) >= queued > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{worker.hostname} did not start consuming {DEFAULT_QUEUE}")
        for client in env.broker.client_list():
            if client.get("cmd") == "brpop":
                env.broker.client_unblock(int(client["id"]))
        settle = time.monotonic() + 0.05
        while env.broker.llen(DEFAULT_QUEUE) >= queued and time.monotonic() < settle:
            time.sleep(0.002)
    return sent


def throughput_round(env: Env, row: str, task_name: str, locks: str, tasks: int) -> dict[str, Any]:
    env.fresh()
    task = env.app.tasks[task_name]
    worker = env.worker(row, locks)
    try:
        base = env.serial * 1_000_000
        warm_up(env, task, base)
        first = base + env.warmup
        gc.collect()
        gc.disable()  # no collection lands on one row's enqueue loop and not another's
        cpu0, t0 = time.process_time(), time.perf_counter()
        ids = [task.delay(first + i).id for i in range(tasks)]
        t1, cpu1 = time.perf_counter(), time.process_time()
        gc.enable()
        queued = env.broker.llen(DEFAULT_QUEUE)
        if queued != tasks:
            raise RuntimeError(f"{row}: {queued} messages queued, expected {tasks}")
        (main0, pool0), scpu0 = worker.cpu_split_s(), servers_cpu_s(env.server_clients)
        (busy0, steal0), own0 = machine_cpu_s(), time.process_time()
        started = consume(env, worker, tasks)
        wait_results(env.backend, tasks, env.timeout, row)
        (busy1, steal1), own1 = machine_cpu_s(), time.process_time()
        (main1, pool1), scpu1 = worker.cpu_split_s(), servers_cpu_s(env.server_clients)
        metas = read_results(env.backend, ids)
    finally:
        worker.stop()
    wcpu0, wcpu1 = main0 + pool0, main1 + pool1
    bad = [
        (i, m.get("status"), m.get("result"))
        for i, m in enumerate(metas)
        if m.get("status") != "SUCCESS" or m.get("result") != first + i
    ]
    if bad:
        raise RuntimeError(f"{row}: {len(bad)} results wrong, e.g. {bad[:3]}")
    ends = sorted(done_at(m) for m in metas)
    drain = ends[-1] - started
    return {
        "tasks_per_s": tasks / drain,
        "enqueue_us": (t1 - t0) * 1e6 / tasks,
        "enqueue_cpu_us": (cpu1 - cpu0) * 1e6 / tasks,
        "worker_cpu_us": (wcpu1 - wcpu0) * 1e6 / tasks,
        # of which the main process (consuming, dispatching, acking); the rest is the pool's
        "worker_main_cpu_us": (main1 - main0) * 1e6 / tasks,
        "server_cpu_us": (scpu1 - scpu0) * 1e6 / tasks,
        # From the publisher on: what one task costs the machine in all (issue 34).
        "total_cpu_us": ((cpu1 - cpu0) + (wcpu1 - wcpu0) + (scpu1 - scpu0)) * 1e6 / tasks,
        # Busy CPU time of everything else on the machine while the worker drained (other
        # processes, kernel threads), and CPU time stolen by the hypervisor: interference.
        "other_cpu_us": max(
            0.0,
            (busy1 - busy0) - (wcpu1 - wcpu0) - (scpu1 - scpu0) - (own1 - own0),
        )
        * 1e6
        / tasks,
        "steal_us": (steal1 - steal0) * 1e6 / tasks,
        "drain_s": drain,
        "first_result_s": ends[0] - started,
    }


def storm(env: Env, row: str, task_name: str, tasks: int, secs: float) -> dict[str, Any]:
    """``tasks`` calls with identical arguments (one key); see the module docstring."""
    env.fresh()
    task = env.app.tasks[task_name]
    worker = env.worker(f"storm-{row}", "single")
    ids: list[str] = []
    refused: dict[str, int] = {}
    try:
        warm_up(env, task, env.serial * 1_000_000)
        env.backend.flushdb()
        t0 = time.perf_counter()
        for k in range(tasks):
            # plain: the first message sleeps, the others end at once and, so that they cost
            # no more than an empty task, do not write to the journal (see the docstring)
            full = row != "plain" or k == 0
            try:
                ids.append(task.delay(0, secs=secs if full else 0.0, count=full).id)
            except Exception as exc:  # celery-once: AlreadyQueued
                refused[type(exc).__name__] = refused.get(type(exc).__name__, 0) + 1
        t1 = time.perf_counter()
        published = env.broker.llen(DEFAULT_QUEUE)
        started = consume(env, worker, published)
        wait_results(env.backend, published, env.timeout + secs, f"storm {row}")
        distinct = list(dict.fromkeys(ids))
        metas = read_results(env.backend, distinct)
        executed = int(env.journal.get(EXECUTED_KEY) or 0)
        if row == "plain":
            executed += published - 1  # the empty bodies, which did not count themselves
    finally:
        worker.stop()
    if any(m.get("status") != "SUCCESS" for m in metas):
        raise RuntimeError(f"storm {row}: not every result is SUCCESS: {metas[:3]}")
    dropped = [m for m in metas if isinstance(m.get("result"), dict)]
    quick = dropped if row != "plain" else metas[1:]
    return {
        "calls": tasks,
        "body_s": secs,
        "enqueue_us": (t1 - t0) * 1e6 / tasks,
        "published": published,
        "answered_with_existing": len(ids) - len(distinct),
        "refused": refused,
        "executed": executed,
        "dropped": len(dropped),
        "quick_s": max(done_at(m) for m in quick) - started if quick else None,
        "drained_s": max(done_at(m) for m in metas) - started,
    }


# -- the run ------------------------------------------------------------------------------------


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
    tps = [r["tasks_per_s"] for r in rounds]
    out["tasks_per_s_spread"] = round((max(tps) - min(tps)) / statistics.median(tps), 3)
    out["rounds"] = [{k: round(v, 3) for k, v in r.items()} for r in rounds]
    return out


def ratios(figures: dict[str, Any], storms: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row, fig, base_row, target, side in RATIOS:
        base = figures.get(base_row)
        if base is None or row not in figures:
            continue
        value = figures[row][fig] / base[fig]
        met = None if target is None else (value >= target if side == "min" else value <= target)
        per_round = [
            round(r[fig] / b[fig], 3)
            for r, b in zip(figures[row]["rounds"], base["rounds"], strict=True)
        ]
        out[f"{row}/{base_row} {fig}"] = {
            "ratio": round(value, 3),
            "per_round": per_round,
            # Each round's rows run minutes apart at most: the median of the rounds' own
            # ratios is less moved by a host that speeds up or slows down during the run.
            "paired": round(statistics.median(per_round), 3),
            "target": target,
            "side": side,
            "met": met,
        }
    if "plain" in storms and "dlock" in storms:
        s, p = storms["dlock"], storms["plain"]
        out["storm dlock executions"] = {
            "value": s["executed"],
            "target": 1,
            "side": "eq",
            "met": s["executed"] == 1,
        }
        out["storm dlock/plain quick_s"] = {
            "ratio": round(s["quick_s"] / p["quick_s"], 3),
            "target": 1.0,
            "side": "max",
            "met": s["quick_s"] <= p["quick_s"],
        }
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    all_cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    storm_sleep = args.storm_sleep
    if storm_sleep is None:
        storm_sleep = max(0.2, STORM_SLEEP_PER_CALL * args.tasks)
    with redis_servers(7) as servers:
        placement = pin(servers, args.pin)
        hub, lock1, masters = servers[0], servers[1], servers[2:]
        base = f"redis://127.0.0.1:{hub.port}"
        urls = {
            "BENCH_BROKER": f"{base}/0",
            "BENCH_BACKEND": f"{base}/1",
            "BENCH_JOURNAL": f"{base}/2",
            "BENCH_PEER_URL": lock1.url,
        }
        worker_env = {
            "single": {**urls, "BENCH_LOCK_URLS": lock1.url},
            "redlock": {**urls, "BENCH_LOCK_URLS": ",".join(s.url for s in masters)},
        }
        os.environ.update(worker_env["single"])  # this process's copy of the app
        import _throughput_app

        env = Env(
            app=_throughput_app.app,
            broker=redis.Redis.from_url(urls["BENCH_BROKER"]),
            backend=redis.Redis.from_url(urls["BENCH_BACKEND"]),
            journal=redis.Redis.from_url(urls["BENCH_JOURNAL"]),
            lock_clients=[redis.Redis.from_url(s.url) for s in (lock1, *masters)],
            server_clients=[redis.Redis.from_url(s.url) for s in servers],
            worker_env=worker_env,
            worker_cpus=all_cpus,
            concurrency=args.concurrency,
            warmup=args.warmup,
            timeout=args.timeout,
        )
        rows = [r for r in ROWS if r[0] in args.rows]
        per_round: dict[str, list[dict[str, Any]]] = {r[0]: [] for r in rows}
        for rnd in range(args.rounds):
            for row, name, locks in rows if rnd % 2 == 0 else rows[::-1]:
                per_round[row].append(throughput_round(env, row, name, locks, args.tasks))
                say(args, f"round {rnd + 1} {row}: {per_round[row][-1]}")
        storms: dict[str, Any] = {}
        if args.storm:
            names = {r[0]: r[1] for r in ROWS}
            for row in (r for r in STORM_ROWS if r in args.rows):
                storms[row] = storm(env, row, names[row], args.tasks, storm_sleep)
                say(args, f"storm {row}: {storms[row]}")
        info = env.broker.info("server")

    figures = {row: summarize(r) for row, r in per_round.items() if r}
    return {
        "machine": {
            **machine("celery", "kombu", "celery-singleton", "celery-once"),
            "redis-server": info["redis_version"],
        },
        "settings": {
            "tasks": args.tasks,
            "concurrency": args.concurrency,
            "pool": "prefork",
            "rounds": args.rounds,
            "warmup": args.warmup,
            "storm_sleep_s": storm_sleep,
            "pin": placement,
            "worker_cpus": all_cpus,
        },
        "throughput": figures,
        "storm": storms,
        "ratios": ratios(figures, storms),
        "elapsed_s": round(time.monotonic() - began, 1),
    }


def say(args: argparse.Namespace, line: str) -> None:
    if args.verbose:
        print(line, file=sys.stderr, flush=True)


def print_report(result: dict[str, Any]) -> None:
    m, s = result["machine"], result["settings"]
    print(
        f"Python {m['python']}, celery {m['celery']}, kombu {m['kombu']}, redis-py "
        f"{m['redis-py']}, hiredis {m['hiredis']}, celery-singleton {m['celery-singleton']}, "
        f"celery-once {m['celery-once']}, Redis {m['redis-server']}; {m['nproc']} CPU(s): "
        f"{m['cpu']}"
    )
    print(f"celery_dlock: {m['celery_dlock']}")
    print(f"CPU placement: {s['pin']}; worker on CPUs {s['worker_cpus']}")
    print(
        f"{s['tasks']} tasks per row and round, celery worker -P prefork -c {s['concurrency']}, "
        f"{s['rounds']} interleaved rounds; medians over rounds\n"
    )
    figs = result["throughput"]
    plain = figs.get("plain")
    print(
        f"{'row':<17} {'tasks/s':>8} {'/ plain':>7} {'enqueue us':>10} {'/ plain':>7} "
        f"{'enq CPU':>7} {'worker CPU':>10} {'server CPU':>10} {'total':>6} {'other':>5}  "
        "tasks/s per round"
    )
    for row, f in figs.items():
        tp = f"{f['tasks_per_s'] / plain['tasks_per_s']:.3f}" if plain else "-"
        eq = f"{f['enqueue_us'] / plain['enqueue_us']:.3f}" if plain else "-"
        per = " ".join(f"{r['tasks_per_s']:.0f}" for r in f["rounds"])
        print(
            f"{row:<17} {f['tasks_per_s']:>8.1f} {tp:>7} {f['enqueue_us']:>10.1f} {eq:>7} "
            f"{f['enqueue_cpu_us']:>7.0f} {f['worker_cpu_us']:>10.0f} "
            f"{f['server_cpu_us']:>10.0f} {f.get('total_cpu_us', 0):>6.0f} "
            f"{f['other_cpu_us']:>5.0f}  {per}"
        )
    print(
        "(CPU columns: us per task; enq CPU: this process while enqueueing; total: enqueue + "
        "worker + servers; other: the rest of the machine while the worker drained)"
    )
    if result["storm"]:
        print(
            f"\nstorm: {s['tasks']} calls with identical arguments; the body sleeps "
            f"{s['storm_sleep_s']:g} s (plain: only the first message's body)"
        )
        print(
            f"{'library':<17} {'published':>9} {'merged':>7} {'refused':>8} {'executed':>8} "
            f"{'dropped':>8} {'quick s':>8} {'drained s':>9} {'enqueue us':>10}"
        )
        for row, st in result["storm"].items():
            refused = sum(st["refused"].values())
            quick = "-" if st["quick_s"] is None else f"{st['quick_s']:.3f}"
            print(
                f"{row:<17} {st['published']:>9} {st['answered_with_existing']:>7} "
                f"{refused:>8} {st['executed']:>8} {st['dropped']:>8} {quick:>8} "
                f"{st['drained_s']:>9.3f} {st['enqueue_us']:>10.1f}"
            )
    print("\nratios (of medians; per round in brackets; paired: median of those) and targets")
    for key, r in result["ratios"].items():
        value = r.get("ratio", r.get("value"))
        line = f"  {key:<36} {value:>6}"
        if "per_round" in r:
            line += f"  ({' '.join(f'{x:.3f}' for x in r['per_round'])})"
        if "paired" in r:
            line += f"  paired {r['paired']:.3f}"
        if r["target"] is not None:
            bound = {"min": ">=", "max": "<=", "eq": "=="}[r["side"]]
            line += f"   target {bound} {r['target']}: {'met' if r['met'] else 'MISSED'}"
        print(line)
    print(f"\nelapsed {result['elapsed_s']} s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Celery worker throughput and enqueue cost: plain, SingletonTask, peers."
    )
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per row and round")
    parser.add_argument("--concurrency", type=int, default=2, help="worker pool processes")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved throughput rounds")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up tasks per worker")
    parser.add_argument(
        "--storm-sleep",
        type=float,
        default=None,
        help="seconds the storm body sleeps (default: 2 ms per call, at least 0.2)",
    )
    parser.add_argument("--no-storm", dest="storm", action="store_false", help="skip storms")
    names = [r[0] for r in ROWS]
    parser.add_argument("--rows", nargs="+", default=names, choices=names, metavar="ROW")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of each wait")
    parser.add_argument("--pin", choices=("split", "same", "none"), default="split")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    parser.add_argument(
        "--report", metavar="JSON", help="print the report of a saved --json result and exit"
    )
    args = parser.parse_args(argv)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        # Recomputed from the saved figures, so older files get the ratios added since.
        saved["ratios"] = ratios(saved["throughput"], saved["storm"])
        print_report(saved)
        return 0
    result = measure(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
