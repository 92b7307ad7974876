"""The green pools with locks on ZooKeeper: a ``-P gevent`` and a ``-P eventlet`` worker
(``-c 50``, ``-A tests.support.pool_app``) run locked tasks on ``zookeeper://``.

kazoo's threading handler serves gevent as it is (the monkey patching makes its thread and
socket waits green); under eventlet it does not, and the session uses kazoo's eventlet handler
(celery_dlock/zookeeper/session.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import group

from celery_dlock import lock
from tests.support.celery_fixtures import Mode, make_mode
from tests.support.workers import Journal, Worker, intervals, overlaps

pytestmark = [pytest.mark.slow, pytest.mark.local_redis]
MODES = ("zookeeper",)
POOLS = ("gevent", "eventlet")
#: Locked tasks run on each worker.
TASKS = 200


@pytest.fixture(scope="module")
def mode(celery_base: str, zookeeper_session_url: str) -> Mode:
    return make_mode("zookeeper", celery_base, lock_urls=[f"{zookeeper_session_url}?timeout=6"])


@pytest.fixture(scope="module")
def pa(wa: Any) -> Any:
    from tests.support import pool_app

    return pool_app


@pytest.fixture(scope="module", params=POOLS)
def green_worker(request: pytest.FixtureRequest, mode: Mode, pa: Any) -> Iterator[Worker]:
    pool = request.param
    journal = Journal(mode.env["DLOCK_TEST_JOURNAL"])
    worker = Worker(
        mode.env,
        journal,
        name=f"zk-{pool}",
        pool=pool,
        concurrency=50,
        queue=f"zk_{pool}",
        app="tests.support.pool_app",
    ).start(timeout=60)
    yield worker
    worker.stop()


def test_many_locked_tasks(green_worker: Worker, pa: Any) -> None:
    """Locked tasks, 50 at a time, each take and release their key: all succeed, and the
    kazoo connection stays up meanwhile."""
    batch = group(pa.quick.s(n, 0.1) for n in range(TASKS)).apply_async(queue=green_worker.queue)
    assert batch.get(timeout=120) == list(range(TASKS))
    assert "Connection time-out" not in green_worker.log()


def test_one_body_and_lock_wait(green_worker: Worker, pa: Any, mode: Mode) -> None:
    """Calls of one key sent at once never overlap; ``lock(wait=)`` in a task takes the key
    when the test lets it go, while the worker answers other tasks."""
    journal = Journal(mode.env["DLOCK_TEST_JOURNAL"])
    name = f"zk-one-{green_worker.pool}"
    calls = [pa.held.apply_async((name, "sleep", 0.5), queue=green_worker.queue) for _ in range(6)]
    for call in calls:
        call.get(timeout=60)
    spans = intervals(journal.entries(), name=name)
    assert spans, "no body ran"
    assert overlaps(spans) == [], spans
    waited = f"zk-wait-{green_worker.pool}"
    with lock([mode.lock_urls[0]], f"pool:{waited}", ttl=30) as held:
        waiter = pa.lock_waiter.apply_async((waited, 20.0), queue=green_worker.queue)
        journal.wait_for("waiting", id=waiter.id, timeout=30)
        assert pa.ping.apply_async(("x",), queue=green_worker.queue).get(timeout=15) == "x"
        token = held.token
    assert waiter.get(timeout=15) > token
