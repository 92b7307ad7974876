"""The fault scenarios of shared/research/anchor-faults.md run through the compat classes.

The same scenarios measured against celery-singleton 0.3.1 and celery-once 3.0.1 (S1 duplicate
storm, S2 positional vs keyword, S3 revoke, S4 worker crash, S5 retry, S6 a run longer than the
lock lifetime, S7 key deleted under a running task, S8 ``send_task``), here with
``celery_dlock.compat.Singleton`` and ``QueueOnce`` tasks (``work`` and ``flaky`` as in the
measurements, tests/support/compat_app.py) in a real prefork worker. Each test asserts our
behaviour; the comment above it says what the peers did. docs/migrating.md has the table.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

import pytest
from celery import states
from celery.utils import uuid

from celery_dlock import LockLost
from celery_dlock.compat import AlreadyQueued
from tests.support.celery_fixtures import Mode
from tests.support.clients import client
from tests.support.workers import Journal, Worker

pytestmark = pytest.mark.slow


@pytest.fixture(params=["singleton", "once"])
def kind(request: pytest.FixtureRequest) -> str:
    result: str = request.param
    return result


def tasks(ca: ModuleType, kind: str) -> tuple[Any, Any]:
    """(work, flaky) of the compat class ``kind``."""
    if kind == "singleton":
        return ca.work, ca.flaky
    return ca.once_work, ca.once_flaky


def publish(task: Any, args: tuple[Any, ...], **options: Any) -> Any:
    """Publish; the new task's result, or None when the call was a duplicate (Singleton: the
    holder's result came back; QueueOnce: AlreadyQueued)."""
    task_id = uuid()
    try:
        result = task.apply_async(args, task_id=task_id, **options)
    except AlreadyQueued:
        return None
    return result if result.id == task_id else None


def resubmit_until_accepted(task: Any, args: tuple[Any, ...], timeout: float) -> tuple[Any, float]:
    """The anchor's resubmit loop, polling: publish until a call is accepted."""
    deadline = time.monotonic() + timeout
    while True:
        result = publish(task, args)
        if result is not None:
            return result, time.monotonic()
        assert time.monotonic() < deadline, f"no resubmission accepted in {timeout} s"
        time.sleep(0.05)


def name_of(kind: str, a: int, b: int) -> str:
    return f"{kind}-{a}-{b}"


# S1: singleton: 1 run, all callers get the first id; once: 1 run, 20 x AlreadyQueued.
def test_s1_duplicate_storm_runs_once(
    ca: ModuleType, kind: str, compat_worker: Worker, compat_journal: Journal
) -> None:
    work, _ = tasks(ca, kind)
    first = work.delay(1, 1, 1.0)
    compat_journal.wait_for("start", name=name_of(kind, 1, 1))
    assert [publish(work, (1, 1, 1.0)) for _ in range(20)] == [None] * 20
    if kind == "singleton":
        assert {work.delay(1, 1, 1.0).id for _ in range(5)} == {first.id}
    assert first.get(timeout=15) == 2
    assert len(compat_journal.select("start", name=name_of(kind, 1, 1))) == 1


# S2: singleton: two keys, 2 runs, 1.95 s overlap; once: 1 run.
def test_s2_positional_and_keyword_spellings_are_one_key(
    ca: ModuleType, kind: str, compat_worker: Worker, compat_journal: Journal
) -> None:
    work, _ = tasks(ca, kind)
    first = work.delay(1, 2, 0.5)
    assert publish(work, (), kwargs={"a": 1, "b": 2, "secs": 0.5}) is None
    assert first.get(timeout=15) == 3
    assert len(compat_journal.select("start", name=name_of(kind, 1, 2))) == 1


# S3: both peers keep the key after revoke(terminate=True, signal="SIGKILL"): singleton with no
# expiry (every later call gets the REVOKED task), once for the rest of the hour (AlreadyQueued);
# no new execution in 15 s.
def test_s3_revoke_frees_the_key(
    ca: ModuleType, kind: str, compat_worker: Worker, compat_journal: Journal
) -> None:
    work, _ = tasks(ca, kind)
    running = work.delay(3, 3, 20.0)
    compat_journal.wait_for("start", name=name_of(kind, 3, 3))
    running.revoke(terminate=True, signal="SIGKILL")
    revoked_at = time.monotonic()
    again, accepted_at = resubmit_until_accepted(work, (3, 3, 0.2), timeout=10)
    assert accepted_at - revoked_at < 3.0
    assert again.get(timeout=15) == 6
    assert running.state == states.REVOKED
    assert len(compat_journal.select("start", name=name_of(kind, 3, 3))) == 2


# S4: both peers keep the dead task's key (singleton: no expiry, calls get a task PENDING for
# ever; once: for the rest of the hour); no execution in 15 s. Here: the key expires dlock_ttl
# (3 s in tests/support/compat_app.py) after the last renewal, and the next call runs.
def test_s4_worker_crash_frees_the_key_after_the_ttl(
    ca: ModuleType, compat_mode: Mode, compat_worker: Worker, compat_journal: Journal
) -> None:
    victim = Worker(
        compat_mode.env,
        compat_journal,
        name="compat-victim",
        queue="compat-victim",
        concurrency=2,
        app="tests.support.compat_app",
    ).start()
    try:
        for kind in ("singleton", "once"):
            work, _ = tasks(ca, kind)
            work.apply_async((4, 4, 30.0), queue="compat-victim")
            compat_journal.wait_for("start", name=name_of(kind, 4, 4))
    finally:
        victim.kill()
    killed_at = time.monotonic()
    for kind in ("singleton", "once"):
        work, _ = tasks(ca, kind)
        again, accepted_at = resubmit_until_accepted(work, (4, 4, 0.2), timeout=10)
        assert accepted_at - killed_at < 3.0 + 1.5
        assert again.get(timeout=15) == 8


# S5: singleton: the retry never runs (state RETRY for ever, key kept with no expiry, a fresh
# call gets the stuck id); once: the retry runs. Here: the retry runs for both, and the key
# is free afterwards.
def test_s5_retry_runs_and_the_key_is_freed(
    ca: ModuleType, kind: str, compat_worker: Worker, compat_journal: Journal
) -> None:
    _, flaky = tasks(ca, kind)
    result = flaky.delay(5, 5)
    assert result.get(timeout=15) == 10
    starts = compat_journal.select("start", name=f"{kind}-flaky-5-5")
    assert [s["retries"] for s in starts] == [0, 1]
    fresh, _ = resubmit_until_accepted(flaky, (5, 5), timeout=5)
    assert fresh.id != result.id
    assert fresh.get(timeout=15) == 10


# S6: both peers, lock lifetime 3 s, 8 s body, duplicate at 4 s: the key had expired, the
# duplicate ran beside the first (4.0 s overlap). Here (lifetime 1 s, 2.5 s body, duplicate at
# 1.5 s): the lifetime covers the queue only; the running task's key is renewed.
def test_s6_a_run_longer_than_the_lock_lifetime_keeps_its_key(
    ca: ModuleType, kind: str, compat_worker: Worker, compat_journal: Journal
) -> None:
    task = ca.short_lived if kind == "singleton" else ca.once_short_lived
    name = f"{kind}-short-6"
    first = task.delay(6, 2.5)
    started = compat_journal.wait_for("start", name=name)[0]["t"]
    while time.monotonic() < started + 1.5:  # past the 1 s lifetime, the run still going
        time.sleep(0.02)
    assert not first.ready()
    assert publish(task, (6, 2.5)) is None
    assert first.get(timeout=15) == 6
    assert len(compat_journal.select("start", name=name)) == 1


# S7: both peers: the running task gets no signal and succeeds, a duplicate runs alongside
# (4.45 s overlap), and the first task's release deletes the duplicate's key, so a third run
# overlaps too. Here: the loss is noticed within a renewal interval and the body stopped with
# LockLost; the duplicate keeps its key (releases are owner-checked), so no third run.
def test_s7_a_deleted_key_stops_the_body(
    ca: ModuleType,
    kind: str,
    compat_mode: Mode,
    compat_worker: Worker,
    compat_journal: Journal,
) -> None:
    work, _ = tasks(ca, kind)
    name = name_of(kind, 7, 7)
    first = work.delay(7, 7, 6.0)
    compat_journal.wait_for("start", name=name)
    key = work.lock_key_for((7, 7, 6.0), {})
    assert client(compat_mode.lock_urls[0]).delete(f"dlock:{{{key}}}") == 1
    deleted_at = time.monotonic()
    duplicate = publish(work, (7, 7, 3.0))  # the key is gone: accepted, as with the peers
    assert duplicate is not None
    with pytest.raises(LockLost):
        first.get(timeout=15)
    interrupted = compat_journal.wait_for("interrupted", name=name)[0]
    assert interrupted["t"] - deleted_at < 2.5  # a renewal interval (ttl/3 = 1 s) and slack
    assert not duplicate.ready(), "the duplicate ended already: the check proves nothing"
    assert publish(work, (7, 7, 3.0)) is None  # the duplicate still holds its key
    assert duplicate.get(timeout=15) == 14
    assert len(compat_journal.select("start", name=name)) == 2  # no third run


# S8: both peers: not deduplicated, 2 runs, 2.95 s overlap. Here: the send_task message is
# marked a duplicate when published (this process imported the task) and the worker drops it,
# its result naming the running task.
def test_s8_send_task_is_deduplicated(
    ca: ModuleType, kind: str, compat_worker: Worker, compat_journal: Journal
) -> None:
    work, _ = tasks(ca, kind)
    first = work.delay(8, 8, 1.5)
    compat_journal.wait_for("start", name=name_of(kind, 8, 8))
    sent = ca.app.send_task(work.name, args=(8, 8, 1.5))
    dropped = sent.get(timeout=15)
    assert dropped["dlock_dropped"] is True
    assert dropped["holder"] == first.id
    assert first.get(timeout=15) == 16
    assert len(compat_journal.select("start", name=name_of(kind, 8, 8))) == 1
