"""SingletonTask with real ``celery worker`` processes (prefork): single Redis, Redlock-5 and
ZooKeeper."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from celery import VERSION, states
from redis.exceptions import RedisError

from celery_dlock.backends.redis.nodes import connect, is_connected
from tests.support.celery_fixtures import Mode, node_timeout, submit_concurrently
from tests.support.workers import Journal, Worker, intervals, overlaps

pytestmark = pytest.mark.slow
MODES = ["single", "redlock5", "zookeeper"]
CELERY_VERSION = (VERSION.major, VERSION.minor)


def stored_result(app: Any, task_id: str, timeout: float, worker: Worker, journal: Journal) -> Any:
    """The result the worker stored for ``task_id``, polled from the result backend for up to
    ``timeout`` seconds (the test's bound on the task, not on the host)."""
    deadline = time.monotonic() + timeout
    while True:
        meta = app.backend.get_task_meta(task_id, cache=False)
        if meta.get("status") in states.READY_STATES:
            assert meta["status"] == states.SUCCESS, meta
            return meta["result"]
        if time.monotonic() > deadline:
            raise AssertionError(explain_missing_result(app, task_id, worker, journal))
        time.sleep(0.05)


def explain_missing_result(app: Any, task_id: str, worker: Worker, journal: Journal) -> str:
    """What is known of a task whose result did not come: its stored state (read afresh, not
    through the waiting consumer), the journal and the worker log's lines about it."""
    meta = app.backend.get_task_meta(task_id)
    log = worker.log().splitlines()
    about = [line for line in log if task_id in line]
    return (
        f"no result for {task_id} in time; stored: {meta.get('status')} {meta.get('result')!r}\n"
        f"journal: {journal.entries()}\n"
        f"worker log about it: {about}\n"
        "worker log tail:\n" + "\n".join(log[-40:])
    )


# -- duplicates --------------------------------------------------------------------------------


def test_drop_50_concurrent_duplicates_run_once_and_name_the_holder(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    results = submit_concurrently(wa.drop_task.delay, [(("storm", 2.0), {})] * 50)
    values = {r.id: r.get(timeout=20) for r in results}
    starts = journal.select("start", name="storm")
    assert len(starts) == 1, starts
    holder = starts[0]["id"]
    assert values[holder] == "storm"
    dropped = [v for task_id, v in values.items() if task_id != holder]
    assert len(dropped) == 49
    for value in dropped:
        assert value["dlock_dropped"] is True
        assert value["holder"] == holder
        assert value["key"].startswith("tests.worker_app.drop_task:")
    # Dropped duplicates finished while the holder still ran, not after it.
    ended = journal.select("end", name="storm")
    assert len(ended) == 1


def test_requeue_runs_all_20_one_at_a_time_with_jittered_delays(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    results = submit_concurrently(
        wa.requeue_task.delay, [(("serial", n, 0.15), {}) for n in range(20)]
    )
    assert sorted(r.get(timeout=90) for r in results) == list(range(20))
    spans = intervals(journal.entries(), name="serial")
    assert len(spans) == 20
    assert overlaps(spans) == []
    delays = [e["retry_in"] for e in journal.select("contended", policy="requeue")]
    assert len(delays) >= 10
    assert len(set(delays)) > len(delays) // 2, f"requeue delays barely differ: {delays}"
    assert all(0.02 <= d <= 1.0 for d in delays)
    # One line of ours per requeue says why; Celery's "Task ... ignored" for it is dropped.
    log = worker.log()
    for result in results:
        assert f"{result.id}] ignored" not in log
    assert sum(log.count(f"requeue_task[{r.id}] requeued in") for r in results) == len(delays)


def test_raise_policy_fails_duplicates_with_lock_contended(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    first = wa.raise_task.delay("raised", 0, 2.0)
    journal.wait_for("start", name="raised")
    second = wa.raise_task.delay("raised", 1)
    with pytest.raises(Exception, match="is held by task") as info:
        second.get(timeout=10)
    assert type(info.value).__name__ == "LockContended"
    assert first.id in str(info.value)
    assert first.get(timeout=10) == 0


def test_wait_policy_blocks_until_the_release(wa: Any, worker: Worker, journal: Journal) -> None:
    first = wa.wait_task.delay("waited", 0, 1.0)
    journal.wait_for("start", name="waited")
    second = wa.wait_task.delay("waited", 1)
    assert second.get(timeout=20) == 1
    assert first.get(timeout=10) == 0
    spans = intervals(journal.entries(), name="waited")
    assert len(spans) == 2
    assert overlaps(spans) == []
    assert spans[1][0] - spans[0][1] < 0.5, "the waiter was not woken by the release"


def test_a_queued_execution_that_looked_again_for_several_blocks_is_woken_by_the_release(
    wa: Any, worker: Worker, journal: Journal, mode: Mode
) -> None:
    # docs/guarantees.md: a release wakes a waiter. The holder's body runs 8 s under a 3 s
    # lock_ttl it renews, so the waiting duplicate's blocks time out (on one Redis it looks
    # again with PTTL between them, its marker counted in blocks and bounded by lock_wait);
    # it must start at the release, not at the end of its block (up to lock_ttl later).
    name = f"looked-{mode.name}"
    first = wa.wait_task.delay(name, 0, 8.0)
    journal.wait_for("start", name=name)
    second = wa.wait_task.delay(name, 1)
    assert second.get(timeout=30) == 1
    assert first.get(timeout=10) == 0
    spans = intervals(journal.entries(), name=name)
    assert len(spans) == 2
    assert overlaps(spans) == []
    assert spans[1][0] - spans[0][1] < 3 / 3, "the waiter was not woken by the release"


def test_different_keys_run_in_parallel(wa: Any, worker: Worker, journal: Journal) -> None:
    a = wa.collect.delay("a", "x", secs=1.0)
    b = wa.collect.delay("a", "y", secs=1.0)
    assert {a.get(timeout=10), b.get(timeout=10)} == {"a:x", "a:y"}
    # Only these two: a straggler of an earlier test (a requeued duplicate) may run meanwhile.
    spans = [s for s in intervals(journal.entries()) if s[2] in {a.id, b.id}]
    assert len(spans) == 2
    assert overlaps(spans), f"collect('a','x') and collect('a','y') did not overlap: {spans}"


def test_positional_keyword_and_default_spellings_share_one_key(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    keys = {
        wa.collect.lock_key_for(("s", "e"), {}),
        wa.collect.lock_key_for((), {"source": "s", "entity": "e"}),
        wa.collect.lock_key_for(("s", "e", None), {}),
        wa.collect.lock_key_for(("s",), {"entity": "e", "window": None}),
    }
    assert keys == {"meta:s:e"}
    first = wa.collect.delay("s", "e", secs=1.5)
    journal.wait_for("start", name="s:e")
    others = [
        wa.collect.delay(source="s", entity="e"),
        wa.collect.delay("s", "e", None),
    ]
    for other in others:
        assert other.get(timeout=10)["holder"] == first.id
    assert first.get(timeout=10) == "s:e"
    assert len(journal.select("start", name="s:e")) == 1


# -- release on every way out ------------------------------------------------------------------


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_revoke_terminate_frees_the_key_within_two_seconds(
    wa: Any, worker: Worker, journal: Journal, how: str
) -> None:
    name = f"revoked-{how}"
    running = wa.long_task.delay(name, 30)
    journal.wait_for("start", name=name)
    revoked_at = time.monotonic()
    wa.app.control.revoke(running.id, terminate=True, signal=how)
    again = wa.long_task.delay(name, 0.1)
    assert again.get(timeout=10) == name
    starts = journal.select("start", name=name)
    assert [s["id"] for s in starts] == [running.id, again.id]
    assert starts[1]["t"] - revoked_at < 2.0
    assert running.state == states.REVOKED


def test_a_waiter_terminated_by_revoke_does_not_hold_up_the_next(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    """``revoke(terminate=True)`` of a duplicate waiting for the key (on_duplicate="wait"),
    then of the holder: the next duplicate starts as soon as after a holder's revoke alone,
    not once the killed waiter's place in line times out."""
    name = "waiter-revoked"
    first = wa.wait_task.delay(name, 0, 30.0)
    journal.wait_for("start", name=name)
    second = wa.wait_task.delay(name, 1)
    deadline = time.monotonic() + 15
    while True:  # the duplicate is in its pool process, waiting for the key
        active = wa.app.control.inspect(timeout=1).active() or {}
        if any(t["id"] == second.id for tasks in active.values() for t in tasks):
            break
        assert time.monotonic() < deadline, "the duplicate never started waiting"
    # Active is not yet in line: on a backend whose waiters have places (ZooKeeper), wait for
    # its place, or a revoke that lands first finds no place to take away (and none is made).
    manager = wa.wait_task._dlock().manager
    if hasattr(manager, "queue"):
        key = wa.wait_task.lock_key_for((name, 1), {})
        while not any(w.task_id == second.id for w in manager.queue(key)[1:]):
            assert time.monotonic() < deadline, "the duplicate never took its place in line"
            time.sleep(0.02)
    wa.app.control.revoke(second.id, terminate=True, signal="SIGKILL")
    third = wa.wait_task.delay(name, 2)
    revoked_at = time.monotonic()
    wa.app.control.revoke(first.id, terminate=True, signal="SIGKILL")
    assert third.get(timeout=30) == 2
    started = journal.select("start", id=third.id)[0]["t"]
    assert [s["id"] for s in journal.select("start", name=name)] == [first.id, third.id]
    # 0.2-0.3 s on Redis on a quiet host; on ZooKeeper the killed waiter's node, which would
    # stay in line for its session's 2-3 s (ZK_SESSION), is deleted once the worker saw its
    # process end. The bound is what the failure would cost at least: 2 s, the shortest session
    # ZooKeeper grants for ZK_SESSION, and on Redis the least left of the holder's 3 s key
    # (renewed every second) that a waiter woken by no release would wait out.
    assert started - revoked_at < 2.0, f"the next started {started - revoked_at:.1f} s later"


def test_retry_releases_and_the_retried_run_acquires_again(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    result = wa.flaky.delay("retried")
    assert result.get(timeout=15) == 1
    starts = journal.select("start", name="retried")
    assert [s["retries"] for s in starts] == [0, 1]
    assert starts[1]["token"] > starts[0]["token"]
    # Between the two runs a duplicate could take the key: the first run did release it.
    assert len(journal.select("end", name="retried")) == 2


def test_deleting_the_key_stops_the_body_with_lock_lost(
    wa: Any, worker: Worker, journal: Journal, mode: Mode
) -> None:
    result = wa.lossy.delay("lossy", 10.0)
    start = journal.wait_for("start", name="lossy")[0]
    mode.delete_lock(start["key"])
    deleted_at = time.monotonic()
    # The reason as each store words it: Redis finds the key gone at the next renewal,
    # ZooKeeper's watch on the holder's node reports its deletion.
    gone = "node was deleted by another client" if mode.zookeeper else "gone"
    with pytest.raises(Exception, match="was lost") as info:
        result.get(timeout=10)
    assert type(info.value).__name__ == "LockLost"
    assert gone in str(info.value)
    assert result.state == states.FAILURE
    lost = journal.wait_for("lost", id=result.id)
    assert lost[0]["t"] - deleted_at < 0.5 + 0.3  # renew interval is ttl/3 = 0.5 s
    assert journal.select("end", name="lossy") == [], "the body ran on after losing its lease"
    # The body itself was told what the final error says: key, reason and fencing token.
    (seen,) = journal.select("interrupted", name="lossy")
    assert (seen["error_key"], seen["error_token"]) == (start["key"], start["token"])
    assert gone in seen["error_reason"]
    assert seen["error"] == str(info.value)


# -- enqueue-time mode -------------------------------------------------------------------------


def publish_together(task: Any, args: tuple[Any, ...], n: int) -> list[Any]:
    """``task.delay(*args)`` from ``n`` threads let go at once, each having opened its own
    connections to the lock nodes beforehand (one at a time, with no shared deadline), so
    the race under test is between the publishes, not between their connects."""
    manager = task._dlock().manager
    results: list[Any] = [None] * n
    barrier = threading.Barrier(n)

    def go(i: int) -> None:
        deadline = time.monotonic() + 20
        for node in getattr(manager, "nodes", ()):  # Redis: every lock node's connection
            conn = node.connection()
            while not is_connected(conn):
                try:
                    connect(node, conn)
                except (RedisError, OSError):
                    assert time.monotonic() < deadline, f"cannot connect to {node.shown}"
        barrier.wait(timeout=30)
        results[i] = task.delay(*args)

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


@pytest.mark.queued_locks
def test_enqueue_mode_returns_the_queued_task_to_duplicates(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    # 25 callers at once. Each thread has its own connections to every node, and opening 125
    # of them together through the shared connector threads outlived the 0.5 s node timeout on
    # a loaded 2-core machine (even with 25; the call is then published without its queued
    # lock, as documented), which is not what this test is about: each thread opens its
    # connections before the callers are let go together.
    # And a node timeout of 2 s for these publishers (this process only). With 0.5 s, a lock
    # server starved that long can make an attempt miss the reply of a node where it took the
    # key: it sees no majority and undoes itself. Publishers that saw its majority meanwhile
    # used to merge into its task id, never published (CI once saw by_name dropped as a
    # duplicate of a task id no caller got); they now merge only into a holder that settled
    # (test_enqueue_publish.py), but a publish without its queued lock would still fail here.
    # The send by name too: with 0.5 s, a starved node made it go out without its queued lock
    # once in a fresh-clone run (it then waited for the first run and ran its body).
    # The first run lasts 4 s so that the send by name goes out while it runs, however long
    # the 25 callers took (on Redlock each may wait until the holder settles or its execution
    # takes the key over).
    with node_timeout(wa.app, 2.0):
        results = publish_together(wa.enqueued, ("queued", 4.0), 25)
        assert len({r.id for r in results}) == 1
        sent_at = time.monotonic()
        by_name = wa.app.send_task("tests.worker_app.enqueued", ("queued", 4.0))
    assert by_name.id != results[0].id
    assert results[0].get(timeout=15) == "queued"
    # Read from the result store, not through this process's result consumer: two full-suite
    # runs timed out in by_name.get(timeout=15) although the test passes alone; the stored
    # state, the journal and the worker log then say whether the worker or the wait missed it.
    dropped = stored_result(wa.app, by_name.id, 15, worker, journal)
    # What ran when, from the send by name on (the first run's events marked True).
    runs = [
        (e["event"], e["id"] == results[0].id, round(e["t"] - sent_at, 3))
        for e in journal.entries()
        if e.get("name") == "queued"
    ]
    assert isinstance(dropped, dict), f"the send by name ran its body: {dropped!r}; {runs}"
    assert dropped["dlock_dropped"] is True
    assert dropped["holder"] == results[0].id
    assert len(journal.select("start", name="queued")) == 1


@pytest.mark.queued_locks
@pytest.mark.skipif(
    CELERY_VERSION < (5, 7),
    reason="before Celery 5.7 a revoke neither marks a reserved ETA task REVOKED nor sends "
    "task_revoked until its ETA: the key frees then (see docs/singleton.md)",
)
def test_enqueue_mode_revoking_the_queued_task_frees_the_key(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    later = wa.enqueued.apply_async(("revoke-queued",), countdown=30)
    assert wa.enqueued.delay("revoke-queued").id == later.id
    wa.app.control.revoke(later.id)
    deadline = time.monotonic() + 10
    while True:  # the worker holds the countdown message; it releases on the revoke
        fresh = wa.enqueued.delay("revoke-queued")
        if fresh.id != later.id:
            break
        assert time.monotonic() < deadline, "revoking the queued task never freed its key"
        time.sleep(0.1)
    assert fresh.get(timeout=10) == "revoke-queued"


@pytest.mark.queued_locks
def test_enqueue_mode_retry_with_countdown_keeps_the_key(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    result = wa.enqueued_flaky.delay("kept", 2.0)
    journal.wait_for("end", name="kept")
    # During the countdown the key belongs to the retry message: duplicates map to it.
    assert wa.enqueued_flaky.delay("kept", 2.0).id == result.id
    assert result.get(timeout=15) == 1
    assert [s["retries"] for s in journal.select("start", name="kept")] == [0, 1]


@pytest.mark.queued_locks
def test_enqueue_mode_a_duplicate_during_a_retrys_countdown_merges_at_once(
    wa: Any, worker: Worker, journal: Journal, mode: Mode
) -> None:
    # The run hands its key over to its retry's message: a queued value written just now. On
    # Redlock a duplicate reading it took it for a publisher's attempt that may yet be undone
    # and waited until it settled (settle_time, 1.5 s here), though the task had already run
    # and its retry was published (its state says RETRY).
    task = wa.enqueued_flaky
    name = f"handed-{mode.name}"  # a retry left over by another mode's failure is not this one
    manager = task._dlock().manager
    key = task.lock_key_for((name, 3.0), {})
    result = task.delay(name, 3.0)
    journal.wait_for("end", name=name)
    deadline = time.monotonic() + 5
    while True:  # the first run's lease becomes the retry message's queued lock
        holder = manager.holder(key)
        if holder is not None and holder.queued:
            break
        assert time.monotonic() < deadline, f"the key was never handed over: {holder}"
        time.sleep(0.01)
    started = time.monotonic()
    duplicate = task.delay(name, 3.0)
    waited = time.monotonic() - started
    assert duplicate.id == result.id
    settle = getattr(manager, "settle_time", 0.0)
    assert waited < 0.5, f"waited {waited:.2f} s (settle time {settle} s)"
    assert result.get(timeout=15) == 1
    assert [s["retries"] for s in journal.select("start", name=name)] == [0, 1]


# -- bad input ----------------------------------------------------------------------------------


def test_an_argument_that_cannot_form_a_key_fails_naming_it(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    result = wa.app.send_task("tests.worker_app.keyed_by_everything", (), {"payload": 1})
    assert result.get(timeout=10) == "ran"
    with pytest.raises(
        Exception, match=r"argument 'payload' of task .* cannot be part of a lock key"
    ):
        wa.keyed_by_everything.apply(kwargs={"payload": object()}).get()


@pytest.mark.parametrize("task_name", ["ignoring", "rejecting"])
def test_ignore_and_reject_release_the_key(
    wa: Any, worker: Worker, journal: Journal, task_name: str
) -> None:
    task = getattr(wa, task_name)
    task.delay(f"{task_name}-1")
    journal.wait_for("start", name=f"{task_name}-1")
    key = task.lock_key_for((f"{task_name}-1",), {})
    manager = task._dlock().manager
    deadline = time.monotonic() + 5
    while manager.holder(key) is not None:  # released as the body ends, not after the ttl
        assert time.monotonic() < deadline, f"{task_name}: the key was never released"
        time.sleep(0.02)
    task.delay(f"{task_name}-1")
    journal.wait_for("start", name=f"{task_name}-1", count=2)


def test_max_hold_bounds_a_hung_body(wa: Any, worker: Worker, journal: Journal, mode: Mode) -> None:
    result = wa.bounded.delay("hung", 10.0)
    with pytest.raises(Exception, match="max_hold"):
        result.get(timeout=10)
    start = journal.select("start", name="hung")[0]
    lost = journal.wait_for("lost", id=result.id)[0]
    if mode.zookeeper:
        # Validity ends exactly max_hold after the acquisition, which came shortly before the
        # body's start (no ttl to live out: the lease is only as long as it is confirmed).
        assert 1.0 - 0.2 <= lost["t"] - start["t"] < 1.0 + 0.4
    else:
        # Renewal stops at max_hold; the lease is lost when its last renewal's validity ends.
        assert 1.0 <= lost["t"] - start["t"] < 1.0 + 0.6 + 0.4


def test_flag_policy_lets_the_body_decide(
    wa: Any, worker: Worker, journal: Journal, mode: Mode
) -> None:
    result = wa.flagged.delay("flag", 2.0)
    start = journal.wait_for("start", name="flag")[0]
    mode.delete_lock(start["key"])
    assert result.get(timeout=10) is True  # ran to the end, and saw its lease lost
    assert journal.select("end", name="flag")
