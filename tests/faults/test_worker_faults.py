"""SingletonTask when processes die, Redis goes away, messages are redelivered, and in the
threads and solo pools: each test runs its own real worker on its own queue."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.signals import before_task_publish
from celery.utils import uuid

from celery_dlock.celery import hooks
from celery_dlock.testing import RedisServer
from tests.support.celery_fixtures import Mode, submit_concurrently
from tests.support.workers import Journal, Worker, intervals, overlaps

pytestmark = [pytest.mark.slow, pytest.mark.local_redis]
#: The lock stores this module's workers run on (tests/conftest.py); on ZooKeeper the session
#: timeout (3 s, tests/support/celery_fixtures.py) plays the tasks' lock_ttl of 3 s.
MODES = ["single", "redlock5", "zookeeper"]


@pytest.fixture
def spawn(mode: Mode, wa: Any, journal: Journal) -> Iterator[Any]:
    """Start workers of this test's own; all are stopped at the end."""
    started: list[Worker] = []

    def start(name: str, queue: str, **options: Any) -> Worker:
        env = {**mode.env, **options.pop("env", {})}
        worker = Worker(env, journal, name=f"{name}-{mode.name}", queue=queue, **options)
        started.append(worker)
        return worker.start()

    yield start
    for worker in started:
        worker.stop()


def test_sigkill_of_the_worker_frees_the_key_after_the_ttl(
    wa: Any, worker: Worker, journal: Journal, spawn: Any
) -> None:
    victim = spawn("victim", "victim_q", concurrency=1)
    wa.wait_task.apply_async(("killed", 0, 30.0), queue="victim_q")
    journal.wait_for("start", name="killed")
    victim.kill()
    killed_at = time.monotonic()
    # The main worker's waiter gets the key once the dead holder's lease expires (ttl 3 s;
    # on ZooKeeper once its session does, 3 s too).
    assert wa.wait_task.delay("killed", 1).get(timeout=20) == 1
    second = journal.select("start", name="killed")[1]
    assert 0.5 < second["t"] - killed_at < 3.0 + 1.0


def test_a_redelivered_copy_does_not_run_while_the_first_holds(
    wa: Any, journal: Journal, spawn: Any
) -> None:
    late = {"DLOCK_TEST_ACKS_LATE": "1", "DLOCK_TEST_VISIBILITY": "2"}
    spawn("first", "vt_q", concurrency=1, env=late)
    result = wa.drop_task.apply_async(("redelivered", 6.0), queue="vt_q")
    journal.wait_for("start", name="redelivered")
    time.sleep(2.5)  # let the message pass its visibility timeout while it runs
    # A second worker restores unacked messages older than the timeout as it starts.
    spawn("second", "vt_q", concurrency=1, env=late)
    # The copy comes back while the first holds the key, and is skipped once it finished.
    waited = journal.wait_for("contended", id=result.id, policy="requeue", timeout=15)
    assert waited[0]["holder"] == result.id
    assert result.get(timeout=15) == "redelivered"
    journal.wait_for("contended", id=result.id, policy="drop", timeout=15)
    starts = journal.select("start", name="redelivered")
    assert [s["id"] for s in starts] == [result.id]


def run_then_kill_its_pool_process(
    task: Any, name: str, journal: Journal, spawn: Any
) -> tuple[Any, dict[str, Any]]:
    """Send ``task`` (``name``, a 2 s body) to a worker of its own with late acks and
    reject_on_worker_lost, and SIGKILL the pool process once the body started (its worker
    lives on and puts the message back at once). The result and the first start's entry."""
    env = {"DLOCK_TEST_ACKS_LATE": "1", "DLOCK_TEST_REJECT_ON_LOST": "1"}
    spawn(name, f"{name}_q", concurrency=1, env=env)
    result = task.apply_async((name, 2.0), queue=f"{name}_q")
    first = journal.wait_for("start", name=name)[0]
    os.kill(first["pid"], signal.SIGKILL)
    return result, first


def test_a_task_whose_pool_process_died_runs_again_once_its_lease_expires(
    wa: Any, journal: Journal, spawn: Any
) -> None:
    # Late acks + reject_on_worker_lost: the worker puts the message back at once, while the
    # dead process's lease still holds the key. The copy must wait for it, not vanish.
    result, first = run_then_kill_its_pool_process(wa.drop_task, "lostchild", journal, spawn)
    assert result.get(timeout=30) == "lostchild"
    starts = journal.select("start", name="lostchild")
    assert [s["id"] for s in starts] == [result.id, result.id]
    # Not before the dead process's lease (ttl 3 s, taken just before the first start) ran
    # out; the worker itself may take a few seconds to notice the lost process.
    assert 3.0 - 0.2 < starts[1]["t"] - first["t"] < 15.0
    assert len(journal.select("end", name="lostchild")) == 1


@pytest.mark.queued_locks
def test_an_enqueue_duplicate_of_a_task_whose_pool_process_died_gets_its_rerun(
    wa: Any, journal: Journal, spawn: Any
) -> None:
    # Late acks + reject_on_worker_lost: the pool process running the queued task dies right
    # after taking its key over. A duplicate sent while the dead process's lease still holds
    # the key merges into that task id; the message put back must run it again once the lease
    # expires, so the duplicate's id does run (no caller is left with an id that never runs).
    result, _ = run_then_kill_its_pool_process(wa.enqueued, "lostenq", journal, spawn)
    duplicate = wa.enqueued.apply_async(("lostenq", 2.0), queue="lostenq_q")
    assert duplicate.id == result.id
    assert duplicate.get(timeout=20) == "lostenq"
    starts = journal.select("start", name="lostenq")
    assert [s["id"] for s in starts] == [result.id, result.id]
    assert len(journal.select("end", name="lostenq")) == 1


@pytest.mark.queued_locks
def test_a_requeue_of_an_enqueue_task_sent_without_celery_dlock_is_not_dropped(
    wa: Any, journal: Journal, spawn: Any
) -> None:
    # A producer without celery_dlock sends the task by name: no queued lock, no header. Its
    # run finds the key held by an execution of its own task id (the test's lease here, as a
    # pool process that died leaves one: late acks + reject_on_worker_lost put its message
    # back at once, before that lease expires) and requeues itself to come back later. The
    # requeue, published in the worker, was taken for a message sent by name and marked a
    # duplicate of the task holding the key: its own id. The worker dropped it: call lost.
    spawn("requeued", "requeued_q", concurrency=1)
    task_id = uuid()
    key = wa.enqueued.lock_key_for(("requeued",), {})
    manager = wa.enqueued._dlock().manager
    lease = manager.acquire(key, ttl=30, holder=task_id, renew=False)
    try:
        before_task_publish.disconnect(hooks.lock_published)  # a process without celery_dlock
        try:
            wa.app.send_task(
                "tests.worker_app.enqueued", ("requeued",), task_id=task_id, queue="requeued_q"
            )
        finally:
            before_task_publish.connect(hooks.lock_published)
        journal.wait_for("contended", id=task_id, policy="requeue")
    finally:
        lease.release()
    # It comes back once the key is free: it runs, or (before) it was dropped.
    ended = journal.wait(
        lambda es: any(
            e["event"] == "start" or e.get("policy") == "drop" for e in es if e.get("id") == task_id
        ),
        15,
        "the requeued copy to run or be dropped",
    )
    seen = [(e["event"], e.get("policy")) for e in ended if e.get("id") == task_id]
    assert ("start", None) in seen, seen
    assert wa.enqueued.AsyncResult(task_id).get(timeout=10) == "requeued"


@pytest.mark.redis_only("points a worker at a Redis URL nothing listens on")
def test_a_worker_that_cannot_reach_its_lock_nodes_says_so_once_at_start(
    wa: Any, worker: Worker, spawn: Any, mode: Mode
) -> None:
    if mode.name != "single":
        pytest.skip("one lock server is enough to show it")
    # The main worker reached its nodes: one line says where its locks are.
    assert "celery_dlock: " in worker.log()
    assert f"singleton task(s); locks on {mode.lock_urls[0]}" in worker.log()
    port = RedisServer().port  # a free port nothing listens on
    url = f"redis://:hunter2@127.0.0.1:{port}/2"
    blind = spawn("blind", "blind_q", env={"DLOCK_TEST_LOCK_URLS": url})
    warnings = [line for line in blind.log().splitlines() if "cannot reach lock node" in line]
    assert len(warnings) == 1, blind.log()
    assert f"redis://:***@127.0.0.1:{port}/2" in warnings[0]
    assert "requeued" in warnings[0]
    assert "WARNING" in warnings[0]
    assert "hunter2" not in blind.log()


@pytest.mark.redis_only("stops and restarts a Redis server of its own")
def test_redis_unreachable_at_start_requeues_and_runs_once_it_is_back(
    wa: Any, journal: Journal, spawn: Any, mode: Mode
) -> None:
    if mode.name != "single":
        pytest.skip("one lock server is enough to show it")
    with RedisServer() as locks:
        worker = spawn("unreachable", "down_q", env={"DLOCK_TEST_LOCK_URLS": locks.url})
        locks.stop()
        result = wa.drop_task.apply_async(("unreachable", 0.0), queue="down_q")
        deadline = time.monotonic() + 15
        while worker.log().count("requeued in") < 2:
            assert time.monotonic() < deadline, worker.log()[-3000:]
            time.sleep(0.05)
        assert "cannot lock" in worker.log()
        assert journal.select("start", name="unreachable") == [], "ran without its lock"
        locks.start()
        assert result.get(timeout=30) == "unreachable"
        assert len(journal.select("start", name="unreachable")) == 1


def test_warm_shutdown_lets_the_task_finish_and_release(
    wa: Any, journal: Journal, spawn: Any
) -> None:
    stopping = spawn("warm", "warm_q", concurrency=1)
    result = wa.drop_task.apply_async(("warm", 1.5), queue="warm_q")
    journal.wait_for("start", name="warm")
    stopping.stop()
    assert result.get(timeout=10) == "warm"
    key = wa.drop_task.lock_key_for(("warm", 1.5), {})
    assert wa.drop_task._dlock().manager.holder(key) is None


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_other_pools(wa: Any, journal: Journal, spawn: Any, mode: Mode, pool: str) -> None:
    queue = f"{pool}_q"
    spawn(pool, queue, pool=pool, concurrency=4 if pool == "threads" else 1)
    # duplicates dropped (solo runs one task at a time, so send the holder first)
    holder = wa.drop_task.apply_async((f"{pool}-storm", 1.0), queue=queue)
    if pool == "threads":
        # Four threads take messages at once: the holder must hold before its duplicates go
        # out, or one of them may acquire first (on ZooKeeper a thread's first request is slow).
        journal.wait_for("start", id=holder.id)
        dups = submit_concurrently(
            lambda: wa.drop_task.apply_async((f"{pool}-storm", 1.0), queue=queue), [((), {})] * 8
        )
        for dup in dups:
            assert dup.get(timeout=10)["holder"] == holder.id
    assert holder.get(timeout=10) == f"{pool}-storm"
    # retry releases and re-acquires
    assert wa.flaky.apply_async((f"{pool}-retry",), queue=queue).get(timeout=15) == 1
    # a lost lease stops the body
    lossy = wa.lossy.apply_async((f"{pool}-lossy", 10.0), queue=queue)
    start = journal.wait_for("start", name=f"{pool}-lossy")[0]
    mode.delete_lock(start["key"])
    with pytest.raises(Exception, match="was lost"):
        lossy.get(timeout=10)
    assert journal.select("end", name=f"{pool}-lossy") == []
    (seen,) = journal.select("interrupted", name=f"{pool}-lossy")
    assert (seen["error_key"], seen["error_token"]) == (start["key"], start["token"])
    gone = "node was deleted by another client" if mode.zookeeper else "gone"
    assert gone in seen["error_reason"]
    spans = intervals(journal.entries())
    assert overlaps([s for s in spans if s[2] == holder.id]) == []
