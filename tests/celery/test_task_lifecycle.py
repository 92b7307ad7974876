"""Regression tests for the Celery-side seams (issue 17), each with real prefork workers.

Every test here failed at 5676fb4: a revoke whose signal the pool process ignores freed the
key under a body that went on; an exhausted retry's fallback ran without its lock; a discarded
copy of a running task freed the running execution's lock; an enqueue-time key differed
between publisher and worker after JSON; an error's fields were lost on the way to the caller;
a celery-singleton or celery-once option was silently ignored.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, states
from celery.backends.base import BaseBackend

from celery_dlock import (
    ConfigError,
    DLockError,
    Holder,
    LockContended,
    LockLost,
    LockUnavailable,
    SingletonTask,
)
from tests.support.celery_fixtures import Mode, make_mode
from tests.support.clients import client
from tests.support.workers import Journal, Worker, intervals, overlaps

pytestmark = [pytest.mark.slow, pytest.mark.local_redis]


@pytest.fixture(scope="module")
def mode(celery_base: str) -> Mode:
    """These are about Celery's side: one Redis for the locks is enough."""
    return make_mode("single", celery_base)


@pytest.fixture
def spawn(mode: Mode, wa: Any, journal: Journal) -> Iterator[Any]:
    """Start workers of this test's own; all are stopped at the end."""
    started: list[Worker] = []

    def start(name: str, queue: str, **options: Any) -> Worker:
        env = {**mode.env, **options.pop("env", {})}
        worker = Worker(env, journal, name=name, queue=queue, **options)
        started.append(worker)
        return worker.start()

    yield start
    for worker in started:
        worker.stop()


def state_of(wa: Any, task_id: str) -> str:
    """The task's state as the result backend has it now (no cached final state)."""
    return str(wa.app.backend.get_task_meta(task_id, cache=False)["status"])


def wait_state(wa: Any, task_id: str, wanted: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while (found := state_of(wa, task_id)) != wanted:
        assert time.monotonic() < deadline, f"{task_id} is {found}, not {wanted}"
        time.sleep(0.02)


def wait_free(wa: Any, key: str, timeout: float) -> float:
    """Poll until nobody holds ``key``; the time.monotonic() at which it was seen free."""
    manager = wa.seam._dlock().manager
    deadline = time.monotonic() + timeout
    while manager.holder(key) is not None:
        assert time.monotonic() < deadline, f"{key!r} still held after {timeout} s"
        time.sleep(0.01)
    return time.monotonic()


def assert_dropped(result: Any, holder_id: str) -> None:
    value = result.get(timeout=15)
    assert isinstance(value, dict), f"the duplicate ran while {holder_id} held the key: {value!r}"
    assert value["dlock_dropped"] is True
    assert value["holder"] == holder_id


# -- 1. revoke(terminate=True) with a signal the pool process does not die of -----------------


@pytest.mark.parametrize(
    ("signal", "env"),
    [("SIGINT", {}), ("SIGTERM", {"REMAP_SIGTERM": "SIGQUIT"})],
    ids=["SIGINT", "SIGTERM-remapped"],
)
def test_a_terminate_signal_the_pool_process_ignores_leaves_the_key_to_the_body(
    wa: Any, journal: Journal, spawn: Any, signal: str, env: dict[str, str]
) -> None:
    # Prefork pool processes ignore SIGINT, and SIGTERM when the worker remaps it: the body
    # goes on, so the parent must not free its key; the body releases it when it ends.
    queue = f"ignored_{signal.lower()}_q"
    spawn(f"ignored-{signal.lower()}", queue, concurrency=2, env=env)
    name = f"ignored-{signal}"
    first = wa.seam.apply_async((name, "return", 3.0), queue=queue)
    journal.wait_for("start", id=first.id)
    wa.app.control.revoke(first.id, terminate=True, signal=signal)
    wait_state(wa, first.id, states.REVOKED)  # the parent has announced the revoke
    assert_dropped(wa.seam_probe.apply_async((name,), queue=queue), first.id)
    end = journal.wait_for("end", id=first.id)[0]
    assert end["ended"] == "returned"  # the signal did not stop it
    assert wait_free(wa, "seam:" + name, timeout=5) - end["t"] < 1.0
    assert overlaps(intervals(journal.entries(), name=name)) == []


# -- 2. retries exhausted: the documented fallback ---------------------------------------------


def test_when_retries_are_exhausted_the_fallback_runs_under_the_lock(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    name = "exhausted"
    result = wa.seam.delay(name, "exhausted_fallback", 2.0)
    fallback = journal.wait_for("fallback", id=result.id)[0]
    assert_dropped(wa.seam_probe.delay(name), result.id)
    assert (fallback["lost"], fallback["released"]) == (False, False)
    assert result.get(timeout=15) == "fallback"
    assert [s["id"] for s in journal.select("start", name=name)] == [result.id]


# -- 3. a discarded copy of a running task ------------------------------------------------------


@pytest.mark.parametrize("how", ["expired", "revoked"])
def test_a_discarded_copy_of_a_running_task_leaves_its_lock_alone(
    wa: Any, journal: Journal, spawn: Any, how: str
) -> None:
    # Late acks and a 2 s visibility timeout: the broker hands the running task's message out
    # again; the worker discards that copy (expired, or revoked) and announces the task
    # revoked. That copy never ran, and the execution still running must keep its lock.
    late = {
        "DLOCK_TEST_ACKS_LATE": "1",
        "DLOCK_TEST_VISIBILITY": "2",
        "DLOCK_TEST_RESTORE_EVERY": "0.5",
    }
    worker = spawn(f"discard-{how}", f"discard_{how}_q", concurrency=2, env=late)
    name = f"discarded-{how}"
    expires = {"expires": 1.5} if how == "expired" else {}
    first = wa.seam.apply_async((name, "return", 6.0), queue=f"discard_{how}_q", **expires)
    journal.wait_for("start", id=first.id)
    if how == "revoked":
        wa.app.control.revoke(first.id)  # without terminate: the running one goes on
    deadline = time.monotonic() + 10
    while f"Discarding revoked task: tests.worker_app.seam[{first.id}]" not in worker.log():
        assert time.monotonic() < deadline, worker.log()[-3000:]
        time.sleep(0.05)
    assert_dropped(wa.seam_probe.apply_async((name,), queue=f"discard_{how}_q"), first.id)
    wait_state(wa, first.id, states.SUCCESS)
    assert journal.select("lost", id=first.id) == []
    assert [e["ended"] for e in journal.select("end", name=name)] == ["returned"]


# -- 4. enqueue-time keys across the wire --------------------------------------------------------


def test_an_enqueue_time_key_is_the_same_at_publish_and_in_the_worker(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    # JSON gives {1: 10} back as {"1": 10}: keyed differently at the two ends, the queued
    # lock was never taken over, outlived the task, and swallowed every later call.
    first = wa.seam_payload.delay({1: 10})
    assert first.get(timeout=10) == "payload"  # released as the body ended
    again = wa.seam_payload.delay({1: 10})
    assert again.id != first.id, "merged into a task that had finished"
    assert again.get(timeout=10) == "payload"
    assert [s["id"] for s in journal.select("start", name="payload")] == [first.id, again.id]
    # What the publisher keys is what the worker keys: the JSON round trip's form.
    key = wa.seam_payload.lock_key_for(({1: 10},), {})
    assert key == wa.seam_payload.lock_key_for(({"1": 10},), {})
    assert journal.select("start", id=again.id)[0]["key"] == key


# -- 5. errors reach the caller whole ------------------------------------------------------------


def test_lock_errors_reach_the_caller_with_their_fields(
    wa: Any, worker: Worker, journal: Journal, mode: Mode
) -> None:
    first = wa.raise_task.delay("fields", 0, 2.0)
    journal.wait_for("start", id=first.id)
    with pytest.raises(LockContended) as contended:
        wa.raise_task.delay("fields", 1).get(timeout=10)
    error = contended.value
    assert error.key == wa.raise_task.lock_key_for(("fields",), {})
    assert error.holder is not None
    assert error.holder.task_id == first.id
    assert error.retry_after is not None
    assert 0 < error.retry_after <= 3
    assert first.id in str(error)
    assert first.get(timeout=10) == 0

    lossy = wa.lossy.delay("fields-lost", 10.0)
    start = journal.wait_for("start", id=lossy.id)[0]
    for url in mode.lock_urls:
        client(url).delete(f"dlock:{{{start['key']}}}")
    with pytest.raises(LockLost) as lost:
        lossy.get(timeout=10)
    assert (lost.value.key, lost.value.token) == (start["key"], start["token"])
    assert "gone" in lost.value.reason


@pytest.mark.parametrize("serializer", ["json", "pickle", "msgpack", "yaml"])
def test_lock_errors_keep_their_fields_through_every_result_serializer(serializer: str) -> None:
    app = Celery("fields", set_as_current=False)
    app.conf.result_accept_content = [serializer]
    backend = BaseBackend(app, serializer=serializer)
    holder = Holder(token="t0k", holder="task-1", host="h", pid=7, since=1.5, fence=42)
    errors: list[DLockError] = [
        LockContended("held", key="k", holder=holder, retry_after=1.25),
        LockLost("lost", key="k", reason="gone", token=42),
        LockUnavailable("down", key="k", errors=[("redis://a", "refused")]),
        ConfigError("bad", key="k"),
    ]
    for error in errors:
        stored = backend.encode(backend.prepare_exception(error))
        back = backend.exception_to_python(backend.decode(stored))
        assert type(back) is type(error)
        assert str(back) == str(error)
        assert vars(back) == vars(error), serializer


# -- 6. leftover options of celery-singleton and celery-once -------------------------------------


@pytest.mark.parametrize(
    ("option", "replacement"),
    [
        ({"unique_on": ["source"]}, "write lock_key=['source'] instead"),
        ({"unique_on": "source"}, "write lock_key=['source'] instead"),
        ({"unique_on": []}, "write lock_key=[] instead"),
        ({"raise_on_duplicate": True}, "on_duplicate='raise'"),
        ({"lock_expiry": 60}, "write lock_queued_ttl="),
        (
            {"once": {"keys": ["source"], "timeout": 60}},
            "write @app.task(base=SingletonTask, lock_on='enqueue', lock_key=['source'], "
            "lock_queued_ttl=60) instead",
        ),
    ],
    ids=[
        "unique_on",
        "unique_on-str",
        "unique_on-empty",
        "raise_on_duplicate",
        "lock_expiry",
        "once",
    ],
)
def test_a_peer_option_left_on_a_task_is_refused_naming_the_replacement(
    option: dict[str, Any], replacement: str
) -> None:
    app = Celery("peers", set_as_current=False)
    with pytest.raises(ConfigError) as info:

        @app.task(base=SingletonTask, shared=False, name="peers.collect", **option)
        def collect(source: str, entity: str) -> None: ...

        collect._get_current_object()  # Celery builds the task class lazily
    (name,) = option
    assert f"task 'peers.collect': {name}={option[name]!r} is an option of celery-" in str(
        info.value
    )
    assert replacement in str(info.value)


def test_a_peer_option_given_per_call_is_refused_before_anything_is_sent(
    wa: Any, worker: Worker, journal: Journal, mode: Mode
) -> None:
    with pytest.raises(ConfigError, match=r"apply_async\(\): once=\{'graceful': True\}"):
        wa.seam.apply_async(("per-call",), once={"graceful": True})
    with pytest.raises(ConfigError, match="unique_on="):
        wa.seam_enqueued.apply_async(("per-call",), unique_on=["name"])
    assert client(mode.env["DLOCK_TEST_BROKER"]).llen("celery") == 0
    assert wa.seam.apply_async(("per-call", "return", 0.0)).get(timeout=10) == "per-call"
