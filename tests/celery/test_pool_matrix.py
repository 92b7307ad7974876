"""The pool matrix: Celery's five worker pools by the lock's core behaviours, on real workers.

One ``celery worker`` per pool (``-A tests.support.pool_app``) serves every row of that pool; the
worker-kill row runs last and kills it. The locks live on a Redis server of this module's own,
so the connections a worker opens to the lock server can be counted (``INFO clients``).

:data:`HOLDS` says on which pools each row holds; where it does not, the test checks what
happens instead (docs/singleton.md, "Pools", says the same: a test below keeps the table and
this matrix in step).
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import group, states

from celery_dlock import LockLost, lock
from celery_dlock.backends.redis.connecting import POLLIN, SelectPoll
from celery_dlock.testing import RedisServer, redis_servers
from tests.support.celery_fixtures import Mode, make_mode
from tests.support.clients import client
from tests.support.workers import Journal, Worker, intervals, overlaps

pytestmark = [pytest.mark.slow, pytest.mark.local_redis]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "singleton.md"
POOLS = ("prefork", "threads", "solo", "gevent", "eventlet")
GREEN = ("gevent", "eventlet")
CONCURRENCY = {"prefork": 2, "threads": 4, "solo": 1, "gevent": 50, "eventlet": 50}
#: tests/support/pool_app.py's lease length for ``held``.
TTL = 1.5
#: "At once", allowing for a loaded test machine.
PROMPT = 1.0
#: Locked tasks run to count the connections a worker opens to the lock server (the issue's
#: figure: DLOCK_POOL_TASKS=1000 ... -s -k connections prints it per pool).
TASKS = int(os.environ.get("DLOCK_POOL_TASKS", "200"))

#: On which pools each row holds (the rest: see the test, and docs/singleton.md "Pools").
HOLDS: dict[str, tuple[str, ...]] = {
    "one-body": POOLS,
    "renews-while-yielding": POOLS,
    "release-success": POOLS,
    "release-exception": POOLS,
    "release-revoke": ("prefork", "gevent", "eventlet"),
    "release-kill": POOLS,
    "lock-wait": POOLS,
    "loss-reported": POOLS,
    "loss-stops-body": ("prefork", "threads", "solo"),
    "cpu-bound-renews": ("prefork", "threads", "solo"),
    "connections-bounded": POOLS,
}


def holds(row: str, pool: str) -> bool:
    return pool in HOLDS[row]


# -- servers and workers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lock_server() -> Iterator[RedisServer]:
    """The lock server, the matrix's own: nothing else connects to it."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def mode(celery_base: str, lock_server: RedisServer) -> Mode:
    return make_mode("single", celery_base, lock_urls=[lock_server.url])


class Workers:
    """One worker per pool, started when first needed (again after the kill row)."""

    def __init__(self, mode: Mode, journal: Journal) -> None:
        self.mode = mode
        self.journal = journal
        self.started: dict[str, Worker] = {}

    def get(self, pool: str) -> Worker:
        worker = self.started.get(pool)
        if worker is None or worker.process is None or worker.process.poll() is not None:
            worker = Worker(
                self.mode.env,
                self.journal,
                name=f"pool-{pool}",
                pool=pool,
                concurrency=CONCURRENCY[pool],
                queue=f"pool_{pool}",
                app="tests.support.pool_app",
            )
            self.started[pool] = worker.start(timeout=60)
        return worker

    def stop(self) -> None:
        for worker in self.started.values():
            worker.stop()


@pytest.fixture(scope="module")
def pa(wa: Any) -> Any:
    """The test process's copy of ``tests.support.pool_app`` (its app is ``wa``'s, pointed at the
    module's servers)."""
    from tests.support import pool_app

    return pool_app


@pytest.fixture(scope="module")
def workers(mode: Mode, pa: Any) -> Iterator[Workers]:
    found = Workers(mode, Journal(mode.env["DLOCK_TEST_JOURNAL"]))
    yield found
    found.stop()


def key_of(name: str) -> str:
    return f"dlock:{{pool:{name}}}"


def wait_free(mode: Mode, name: str, timeout: float) -> float:
    """Wait until nobody holds ``pool:{name}``; when that was seen."""
    redis = client(mode.lock_urls[0])
    deadline = time.monotonic() + timeout
    while redis.exists(key_of(name)):
        assert time.monotonic() < deadline, f"pool:{name} still held after {timeout} s"
        time.sleep(0.005)
    return time.monotonic()


def outcome(pa: Any, task_id: str, timeout: float = 30) -> tuple[str, Any]:
    """The task's final state and stored result (or error), waited for."""
    deadline = time.monotonic() + timeout
    while True:
        meta = pa.app.backend.get_task_meta(task_id, cache=False)
        if meta["status"] in states.READY_STATES:
            return meta["status"], meta["result"]
        assert time.monotonic() < deadline, f"{task_id} is {meta['status']} after {timeout} s"
        time.sleep(0.02)


def run_held(pa: Any, journal: Journal, worker: Worker, name: str, how: str, secs: float) -> Any:
    result = pa.held.apply_async((name, how, secs), queue=worker.queue)
    journal.wait_for("start", id=result.id, timeout=30)
    return result


# -- the rows ------------------------------------------------------------------------------------


@pytest.mark.parametrize("pool", POOLS)
def test_one_body_per_key(pool: str, pa: Any, journal: Journal, workers: Workers) -> None:
    """Calls of one key sent at once: never two bodies at once; the rest are dropped."""
    worker = workers.get(pool)
    name = f"one-{pool}"
    results = [pa.held.apply_async((name, "sleep", 0.5), queue=worker.queue) for _ in range(6)]
    outcomes = {result.id: outcome(pa, result.id) for result in results}
    spans = intervals(journal.entries(), name=name)
    assert spans, "no body ran"
    assert overlaps(spans) == [], spans
    ran = {span[2] for span in spans}
    for task_id, (state, value) in outcomes.items():
        if task_id in ran:
            assert (state, value) == (states.SUCCESS, name)
        else:  # dropped, naming a holder that ran
            assert state == states.SUCCESS, value
            assert value["dlock_dropped"] is True, value
            assert value["holder"] in ran, value
    # With one process at a time, the calls may also run one after another; with more, some
    # are dropped while the first runs.
    if CONCURRENCY[pool] > 1:
        assert len(spans) < len(results), spans


@pytest.mark.parametrize("pool", POOLS)
def test_renews_while_yielding(pool: str, pa: Any, journal: Journal, workers: Workers) -> None:
    """A body that yields keeps its lease for twice lock_ttl: renewal runs beside it."""
    worker = workers.get(pool)
    result = run_held(pa, journal, worker, f"renew-{pool}", "sleep", 2 * TTL)
    assert outcome(pa, result.id) == (states.SUCCESS, f"renew-{pool}")
    (end,) = journal.select("end", id=result.id)
    assert end["lost"] is False
    assert journal.select("lost", id=result.id) == []


@pytest.mark.parametrize("how", ["return", "raise"])
@pytest.mark.parametrize("pool", POOLS)
def test_release(pool: str, how: str, pa: Any, journal: Journal, workers: Workers) -> None:
    """The key frees at once when the body returns or raises."""
    worker = workers.get(pool)
    name = f"release-{how}-{pool}"
    result = run_held(pa, journal, worker, name, "raise" if how == "raise" else "sleep", 0.3)
    (end,) = journal.wait_for("end", id=result.id, timeout=30)
    freed = wait_free(workers.mode, name, timeout=2 * TTL + 5)
    assert freed - end["t"] < PROMPT, freed - end["t"]
    state, _ = outcome(pa, result.id)
    assert state == (states.FAILURE if how == "raise" else states.SUCCESS)


@pytest.mark.parametrize("pool", POOLS)
def test_release_on_revoke(pool: str, pa: Any, journal: Journal, workers: Workers) -> None:
    """``revoke(terminate=True)`` stops the body and frees the key at once, where the pool
    can terminate a task; elsewhere the body runs on, holding the key, to its end."""
    worker = workers.get(pool)
    name = f"revoke-{pool}"
    secs = 4.0
    result = run_held(pa, journal, worker, name, "sleep", secs)
    pa.app.control.revoke(result.id, terminate=True)
    freed = wait_free(workers.mode, name, timeout=secs + 5)
    (end,) = journal.wait_for("end", id=result.id, timeout=10)
    if holds("release-revoke", pool):
        (start,) = journal.select("start", id=result.id)
        assert end["ended"] != "returned", end
        assert end["t"] - start["t"] < secs, end
        assert freed - end["t"] < PROMPT, freed - end["t"]
    else:  # nothing stopped it: it ran its 4 s, and let the key go then
        assert end["ended"] == "returned", end
        assert freed >= end["t"]


@pytest.mark.parametrize("pool", POOLS)
def test_lock_wait_inside_a_task(pool: str, pa: Any, journal: Journal, workers: Workers) -> None:
    """``lock(wait=)`` in a task takes the key when its holder lets go; meanwhile the worker
    runs its other tasks (the wait blocks neither the pool nor, on gevent/eventlet, the hub)."""
    worker = workers.get(pool)
    name = f"wait-{pool}"
    with lock([workers.mode.lock_urls[0]], f"pool:{name}", ttl=30) as held:
        result = pa.lock_waiter.apply_async((name, 20.0), queue=worker.queue)
        journal.wait_for("waiting", id=result.id, timeout=30)
        if CONCURRENCY[pool] > 1:
            assert pa.ping.apply_async((name,), queue=worker.queue).get(timeout=15) == name
        assert journal.select("acquired", id=result.id) == []
        token = held.token
    assert result.get(timeout=15) > token


@pytest.mark.parametrize("pool", POOLS)
def test_lease_loss(pool: str, pa: Any, journal: Journal, workers: Workers) -> None:
    """The key deleted behind a running body: the loss is reported (``lock_lost``, the task
    fails with ``LockLost``); where the pool allows, the body is stopped there and then."""
    worker = workers.get(pool)
    name = f"loss-{pool}"
    secs = 3.0
    result = run_held(pa, journal, worker, name, "sleep", secs)
    (start,) = journal.select("start", id=result.id)
    client(workers.mode.lock_urls[0]).delete(key_of(name))
    journal.wait_for("lost", id=result.id, timeout=2 * TTL + 5)
    state, error = outcome(pa, result.id)
    assert state == states.FAILURE
    assert isinstance(error, LockLost), error
    (end,) = journal.select("end", id=result.id)
    assert end["lost"] is True
    if holds("loss-stops-body", pool):
        assert end["ended"] == "LockLost", end
        assert end["t"] - start["t"] < secs - 1, end
    else:  # it runs to its end; its task still fails with LockLost
        assert end["ended"] == "returned", end
        assert end["t"] - start["t"] >= secs
        assert "it is a greenlet (gevent or eventlet pool), which cannot be" in worker.log()


@pytest.mark.parametrize("pool", POOLS)
def test_cpu_bound_body(pool: str, pa: Any, journal: Journal, workers: Workers) -> None:
    """A body that computes for twice lock_ttl without yielding keeps its lease where the
    watchdog is a real thread; on gevent and eventlet the watchdog cannot run meanwhile, the
    lease lapses, and the task fails with ``LockLost``: the overlap is reported, not silent."""
    worker = workers.get(pool)
    name = f"spin-{pool}"
    result = run_held(pa, journal, worker, name, "spin", 2 * TTL)
    state, error = outcome(pa, result.id)
    (end,) = journal.select("end", id=result.id)
    if holds("cpu-bound-renews", pool):
        assert (state, error) == (states.SUCCESS, name)
        assert end["lost"] is False
    else:
        assert state == states.FAILURE
        assert isinstance(error, LockLost), error


@pytest.mark.parametrize("pool", GREEN)
def test_hard_time_limit(pool: str, pa: Any, journal: Journal, workers: Workers) -> None:
    """A task's hard time limit is its lease's default ``lock_max_hold`` only where the pool
    enforces it. gevent's stops the body at the limit and the key frees at once; eventlet's
    pool has no time limits, so the body runs on past it, and it must keep its key meanwhile:
    a duplicate sent once a lease capped at the limit would have lapsed is dropped, naming it."""
    worker = workers.get(pool)
    name = f"limit-{pool}"
    limit, secs = 1.0, 1.0 + 4 * TTL
    result = pa.held.apply_async((name, "sleep", secs), queue=worker.queue, time_limit=limit)
    (start,) = journal.wait_for("start", id=result.id, timeout=30)
    if pool == "gevent":
        (end,) = journal.wait_for("end", id=result.id, timeout=30)
        assert end["ended"] == "Timeout", end
        assert end["t"] - start["t"] < secs, end
        freed = wait_free(workers.mode, name, timeout=2 * TTL + 5)
        assert freed - end["t"] < PROMPT, freed - end["t"]
        state, error = outcome(pa, result.id)
        assert state == states.FAILURE, error
        assert "TimeLimitExceeded" in repr(error), error
        return
    # A lease capped at the limit lapses within lock_ttl after it; this one must not.
    time.sleep(max(0.0, start["t"] + limit + 2 * TTL - time.monotonic()))
    duplicate = pa.held.apply_async((name, "sleep", 0.1), queue=worker.queue)
    state, value = outcome(pa, duplicate.id)
    assert outcome(pa, result.id) == (states.SUCCESS, name)
    spans = intervals(journal.entries(), name=name)
    assert overlaps(spans) == [], spans
    assert state == states.SUCCESS, value
    assert value["dlock_dropped"] is True, value
    assert value["holder"] == result.id, value


@pytest.mark.parametrize("pool", POOLS)
def test_connections_bounded(
    pool: str, pa: Any, journal: Journal, workers: Workers, lock_server: RedisServer
) -> None:
    """Connections the worker opens to the lock server over many locked tasks are bounded by
    its concurrency, not by the tasks run."""
    worker = workers.get(pool)
    redis = client(workers.mode.lock_urls[0])

    def received() -> int:
        return int(redis.info("stats")["total_connections_received"])

    before = received()
    # Each body sleeps, so the pool runs as many at once as its concurrency allows (a green
    # pool's 50 only with longer sleeps: the broker hands out tasks more slowly than that).
    secs = 0.3 if pool in GREEN else 0.02
    batch = group(pa.quick.s(n, secs) for n in range(TASKS)).apply_async(queue=worker.queue)
    assert batch.get(timeout=120) == list(range(TASKS))
    opened = received() - before
    processes = CONCURRENCY[pool] if pool == "prefork" else 1
    # Each task thread's (or greenlet's) one connection; per process, the watchdog's, the
    # cleanup thread's, and one spare; the parent's start-up check.
    bound = CONCURRENCY[pool] + 3 * processes + 1
    print(f"\n{pool} -c {CONCURRENCY[pool]}: {opened} connections for {TASKS} tasks of {secs} s")
    assert opened <= bound, f"{opened} connections for {TASKS} tasks on -c {CONCURRENCY[pool]}"


def test_waiting_duplicates_hold_pool_slots(pa: Any, journal: Journal, workers: Workers) -> None:
    """``on_duplicate="wait"`` waits in the pool: two waiting duplicates on a ``-c 2`` prefork
    worker leave no process for an unrelated task, which starts only once the key frees
    (docs/singleton.md says so)."""
    worker = workers.get("prefork")
    name = "slots"
    inspect = pa.app.control.inspect(destination=[worker.hostname], timeout=2)
    with lock([workers.mode.lock_urls[0]], f"pool:{name}", ttl=30):
        waiters = [pa.waits.apply_async((name,), queue=worker.queue) for _ in range(2)]
        deadline = time.monotonic() + 30
        while len((inspect.active() or {}).get(worker.hostname, [])) < 2:
            assert time.monotonic() < deadline, "the two duplicates never both waited"
            time.sleep(0.05)
        pinged = pa.ping.apply_async((name,), queue=worker.queue)
        wait_log(worker, f"Task tests.pool_app.ping[{pinged.id}] received")
        released = time.monotonic()
    assert pinged.get(timeout=30) == name
    (ping,) = journal.select("ping", name=name)
    assert ping["t"] > released, "the unrelated task ran while both processes waited"
    for waiter in waiters:
        assert waiter.get(timeout=30) == name


def wait_log(worker: Worker, text: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while text not in worker.log():
        assert time.monotonic() < deadline, f"never logged: {text}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def redlock_servers() -> Iterator[list[RedisServer]]:
    with redis_servers(3) as servers:
        yield servers


def received(url: str) -> int:
    """Connections the server at ``url`` has accepted since it started."""
    return int(client(url).info("stats")["total_connections_received"])


@pytest.mark.parametrize("pool", GREEN)
def test_redlock_on_green_pools(
    pool: str, pa: Any, journal: Journal, workers: Workers, redlock_servers: list[RedisServer]
) -> None:
    """Redlock over three nodes on a green pool: the fan-out waits for several sockets at once
    (a poll, which eventlet takes away); renewal while the body yields; connections per node
    bounded by the concurrency."""
    urls = [server.url for server in redlock_servers]
    worker = Worker(
        {**workers.mode.env, "DLOCK_TEST_LOCK_URLS": ",".join(urls)},
        workers.journal,
        name=f"redlock-{pool}",
        pool=pool,
        concurrency=CONCURRENCY[pool],
        queue=f"redlock_{pool}",
        app="tests.support.pool_app",
    )
    worker.start(timeout=60)
    try:
        before = [received(url) for url in urls]
        result = run_held(pa, journal, worker, f"redlock-{pool}", "sleep", 2 * TTL)
        tasks = TASKS // 2
        batch = group(pa.quick.s(n) for n in range(tasks)).apply_async(queue=worker.queue)
        assert batch.get(timeout=120) == list(range(tasks))
        assert outcome(pa, result.id) == (states.SUCCESS, f"redlock-{pool}")
        (end,) = journal.select("end", id=result.id)
        assert end["lost"] is False
        opened = [received(url) - was for url, was in zip(urls, before, strict=True)]
        assert max(opened) <= CONCURRENCY[pool] + 4, opened
        for line in worker.log().splitlines():
            assert not any(broken in line for broken in BROKEN), line
    finally:
        worker.stop()


def test_an_ended_threads_connection_serves_the_next_thread(server: RedisServer) -> None:
    """Twenty short-lived threads, one after another, each taking a lock: the server accepts
    one connection for them all, not one per thread (as when a thread's connection closed
    with it; a gevent or eventlet pool runs each task in a new greenlet, a thread to us)."""
    urls = [server.url]
    guard = lock(urls, "threads", ttl=5)
    guard.acquire().release()  # this thread's own connection: made before counting
    before = received(server.url)

    def one() -> None:
        with guard:
            pass

    for _ in range(20):
        thread = threading.Thread(target=one)
        thread.start()
        thread.join()
    # CPython drops a thread's locals before join() returns (3.11): one connection for all.
    assert received(server.url) - before <= 2


def test_select_poll_stands_in_for_poll() -> None:
    """What eventlet's workers poll with (``select.poll`` gone): the same answers."""
    left, right = socket.socketpair()
    other, _ = socket.socketpair()
    try:
        polled = SelectPoll()
        polled.register(left, POLLIN)
        polled.register(other.fileno(), POLLIN)
        assert polled.poll(0) == []
        right.send(b"+OK\r\n")
        assert polled.poll(1000) == [(left.fileno(), POLLIN)]
        polled.unregister(left)
        assert polled.poll(0) == []
        right.close()
        polled.register(left)  # EOF is readable too: a stale connection
        assert polled.poll(0) == [(left.fileno(), POLLIN)]
    finally:
        for sock in (left, right, other, _):
            sock.close()


#: What the worker's log must never say: the start-up check or the cleanup thread failing.
BROKEN = ("could not check the lock nodes", "janitor round failed", "has no attribute")


@pytest.mark.parametrize("pool", POOLS)
def test_worker_log(pool: str, workers: Workers) -> None:
    """The worker's start-up check found the lock server; nothing of ours failed in the
    background (the cleanup thread) over the rows run so far."""
    worker = workers.get(pool)
    deadline = time.monotonic() + 15  # the check runs just after the worker says it is ready
    while "singleton task(s); locks on" not in (log := worker.log()):
        assert time.monotonic() < deadline, f"no start-up check in the log:\n{log}"
        time.sleep(0.05)
    for line in log.splitlines():
        assert not any(broken in line for broken in BROKEN), line


@pytest.mark.parametrize("pool", POOLS)
def test_release_on_worker_kill(pool: str, pa: Any, journal: Journal, workers: Workers) -> None:
    """The worker killed outright (SIGKILL, nothing runs): the key frees within lock_ttl.
    Runs last: it kills the pool's shared worker."""
    worker = workers.get(pool)
    name = f"kill-{pool}"
    run_held(pa, journal, worker, name, "sleep", 30.0)
    killed = time.monotonic()
    worker.kill()
    freed = wait_free(workers.mode, name, timeout=2 * TTL + 5)
    assert freed - killed < TTL + PROMPT, freed - killed


# -- the table in docs/singleton.md --------------------------------------------------------------

TABLE_ROW = re.compile(r"^\| `(?P<id>[^`]+)`[^|]*\|(?P<cells>.*)\|\s*$")


def documented() -> dict[str, tuple[str, ...]]:
    """Row id -> the pools the "Pools" table in docs/singleton.md marks "yes"."""
    section = DOCS.read_text().split("\n## Pools", 1)[1].split("\n## ", 1)[0]
    found: dict[str, tuple[str, ...]] = {}
    for line in section.splitlines():
        match = TABLE_ROW.match(line)
        if match is None:
            continue
        cells = [c.strip() for c in match.group("cells").split("|")][: len(POOLS)]
        found[match.group("id")] = tuple(
            pool for pool, cell in zip(POOLS, cells, strict=True) if cell == "yes"
        )
    return found


def test_the_table_and_the_matrix_agree() -> None:
    assert documented() == HOLDS


def test_every_row_has_a_test() -> None:
    names = {name for name in globals() if name.startswith("test_")}
    wanted = {
        "one-body": "test_one_body_per_key",
        "renews-while-yielding": "test_renews_while_yielding",
        "release-success": "test_release",
        "release-exception": "test_release",
        "release-revoke": "test_release_on_revoke",
        "release-kill": "test_release_on_worker_kill",
        "lock-wait": "test_lock_wait_inside_a_task",
        "loss-reported": "test_lease_loss",
        "loss-stops-body": "test_lease_loss",
        "cpu-bound-renews": "test_cpu_bound_body",
        "connections-bounded": "test_connections_bounded",
    }
    assert set(wanted) == set(HOLDS)
    assert set(wanted.values()) <= names
