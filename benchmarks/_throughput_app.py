"""The Celery app ``celery_throughput.py`` runs in its ``celery worker`` subprocesses.

Configured from environment variables that the benchmark sets (every worker gets the same
settings apart from the lock URLs of the variant it serves):

``BENCH_BROKER``       broker URL (a local redis-server)
``BENCH_BACKEND``      result backend URL (the same server, another database)
``BENCH_JOURNAL``      where workers report ``worker_ready`` and storm bodies count executions
``BENCH_LOCK_URLS``    ``dlock_urls``: one URL (single Redis) or five (Redlock), comma-separated
``BENCH_PEER_URL``     the Redis that celery-singleton and celery-once keep their locks in
``BENCH_WORKER_CPUS``  optional CPU list (``0,1``) the worker process and its pool children use

Every task returns its first argument. In the throughput rows that is all a body does, so
what is measured is the per-task overhead of Celery and of the lock library. ``bench.floor``
also makes one ``SET NX PX`` round trip to the lock Redis: the least a lock taken in the worker
costs, with nothing else a lock needs (release, renewal, fencing); ``bench.floor_release``
adds the release, a ``DEL`` whose reply is read before the next command. Storm bodies
(``count=True``) also count themselves in the journal (``INCR``) and sleep ``secs``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from _common import FencedFloor, ReleasingFloor
from celery import Celery, signals
from celery_once import QueueOnce  # type: ignore[import-untyped]
from celery_singleton import Singleton  # type: ignore[import-untyped]

from celery_dlock import SingletonTask

BROKER = os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/0")
BACKEND = os.environ.get("BENCH_BACKEND", "redis://127.0.0.1:6379/1")
JOURNAL = os.environ.get("BENCH_JOURNAL", "redis://127.0.0.1:6379/2")
LOCK_URLS = os.environ.get("BENCH_LOCK_URLS", "redis://127.0.0.1:6379/3").split(",")
PEER_URL = os.environ.get("BENCH_PEER_URL", LOCK_URLS[0])

#: Journal keys.
READY_KEY = "bench:ready"  # worker_ready: one hostname pushed per worker
EXECUTED_KEY = "bench:executed"  # storm bodies that ran

app = Celery("bench", broker=BROKER, backend=BACKEND)
app.conf.update(
    dlock_urls=LOCK_URLS,
    singleton_backend_url=PEER_URL,
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": PEER_URL}},
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=3600,
)

if os.environ.get("BENCH_WORKER_CPUS"):
    # Imported by the worker's main process before it forks its pool: the children inherit.
    os.sched_setaffinity(0, {int(c) for c in os.environ["BENCH_WORKER_CPUS"].split(",")})

_journal: redis.Redis | None = None

#: With ``BENCH_PROBE`` set (``worker_cpu.py``): threads carry their Python name in the OS
#: (``/proc/<pid>/task/<tid>/comm``), and every process logs its cyclic-GC collections.
PROBE = bool(os.environ.get("BENCH_PROBE"))
GC_KEY = "bench:gc"  # one JSON list per process at its exit: [monotonic start, gen, seconds]
_collections: list[tuple[float, int, float]] = []
_gc_started = 0.0

if PROBE:
    import ctypes
    import gc
    import json
    import threading

    _prctl = ctypes.CDLL(None, use_errno=True).prctl
    _bootstrap_inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def _named_bootstrap(self: threading.Thread) -> None:
        _prctl(15, self.name.encode()[:15], 0, 0, 0)  # PR_SET_NAME: this thread's comm
        _bootstrap_inner(self)

    threading.Thread._bootstrap_inner = _named_bootstrap  # type: ignore[attr-defined]

    def _gc_probe(phase: str, info: dict[str, Any]) -> None:
        global _gc_started
        if phase == "start":
            _gc_started = time.monotonic()
        else:
            _collections.append((_gc_started, info["generation"], time.monotonic() - _gc_started))

    gc.callbacks.append(_gc_probe)

    @signals.worker_process_init.connect
    def _forget_parents_collections(**_: Any) -> None:
        _collections.clear()

    @signals.worker_process_shutdown.connect
    def _report_collections(**_: Any) -> None:
        journal().rpush(GC_KEY, json.dumps({"pid": os.getpid(), "gc": _collections}))

    @signals.worker_shutdown.connect
    def _report_parents_collections(**_: Any) -> None:
        journal().rpush(GC_KEY, json.dumps({"pid": os.getpid(), "gc": _collections}))


def journal() -> redis.Redis:
    global _journal
    if _journal is None or _journal.connection_pool.pid != os.getpid():
        _journal = redis.Redis.from_url(JOURNAL)
    return _journal


@signals.worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    journal().rpush(READY_KEY, str(getattr(sender, "hostname", "")))


def _body(n: int, secs: float, count: bool) -> int:
    if count:
        journal().incr(EXECUTED_KEY)
    if secs > 0:
        time.sleep(secs)
    return n


@app.task(name="bench.plain")
def plain(n: int, secs: float = 0.0, count: bool = False) -> int:
    return _body(n, secs, count)


_floor: redis.Redis | None = None


@app.task(name="bench.floor")
def floor(n: int, secs: float = 0.0, count: bool = False) -> int:
    """A plain task plus the one round trip any lock taken in the worker needs (SET NX PX).

    No release, no renewal, no fencing: the key just expires. What it costs over ``plain`` is
    the least an execution-time lock can cost on this host.
    """
    global _floor
    if _floor is None or _floor.connection_pool.pid != os.getpid():
        _floor = redis.Redis.from_url(LOCK_URLS[0])
    _floor.set(f"bench:floor:{n}", "1", nx=True, px=30000)
    return _body(n, secs, count)


_releasing: tuple[int, ReleasingFloor] | None = None


@app.task(name="bench.floor_release")
def floor_release(n: int, secs: float = 0.0, count: bool = False) -> int:
    """``floor`` plus the release (a DEL sent without waiting for its reply): the least an
    execution-time lock that frees its key when the task ends costs."""
    global _releasing
    if _releasing is None or _releasing[0] != os.getpid():
        _releasing = (os.getpid(), ReleasingFloor(LOCK_URLS[0]))
    lock = _releasing[1]
    key = f"bench:floor-release:{n}"
    lock.take(key)
    try:
        return _body(n, secs, count)
    finally:
        lock.give_back(key)


_fenced: tuple[int, FencedFloor] | None = None


@app.task(name="bench.floor_fenced")
def floor_fenced(n: int, secs: float = 0.0, count: bool = False) -> int:
    """``SET NX PX`` + a fence ``INCR`` in one round trip, and a compare-and-delete release
    sent without waiting: the least a lock with our guarantees (a fencing token, a release
    that deletes only its own key) must do in the worker."""
    global _fenced
    if _fenced is None or _fenced[0] != os.getpid():
        _fenced = (os.getpid(), FencedFloor(LOCK_URLS[0]))
    lock = _fenced[1]
    key = f"bench:floor-fenced:{n}"
    lock.take(key)
    try:
        return _body(n, secs, count)
    finally:
        lock.give_back(key)


@app.task(name="bench.dlock", base=SingletonTask, on_duplicate="drop")
def dlock(n: int, secs: float = 0.0, count: bool = False) -> int:
    return _body(n, secs, count)


@app.task(name="bench.dlock_enqueue", base=SingletonTask, on_duplicate="drop", lock_on="enqueue")
def dlock_enqueue(n: int, secs: float = 0.0, count: bool = False) -> int:
    return _body(n, secs, count)


@app.task(name="bench.singleton", base=Singleton)
def singleton(n: int, secs: float = 0.0, count: bool = False) -> int:
    return _body(n, secs, count)


@app.task(name="bench.once", base=QueueOnce)
def once(n: int, secs: float = 0.0, count: bool = False) -> int:
    return _body(n, secs, count)
