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
from _common import ReleasingFloor
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
