"""The Celery glue with Celery's own test fixtures, as docs/testing.md tells users to test:
``celery_app`` and ``celery_config`` of ``celery.contrib.pytest`` (loaded by pytest-celery),
the plugin's in-thread ``dlock_worker`` and its ``dlock`` helpers, on the in-process store and
on a real Redis. What needs processes, signals to processes, crashes or pools runs in real
``celery worker`` subprocesses elsewhere (tests/test_singleton.py, the exit-path and pool
matrices); these are the parts where a worker in a thread is enough."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_dlock import (
    LockContended,
    LockLost,
    SingletonTask,
    lock_acquired,
    lock_released,
)

# Bodies wait on these events rather than sleeping: a test releases them when it has looked.
GATES: dict[str, threading.Event] = {}


def gate(name: str) -> threading.Event:
    return GATES.setdefault(name, threading.Event())


@pytest.fixture(scope="module", params=["memory", "redis"])
def dlock_urls(request: pytest.FixtureRequest) -> list[str]:
    """Each test runs on the in-process store and on the session's real Redis."""
    if request.param == "memory":
        return ["memory://"]
    urls: list[str] = request.getfixturevalue("single_session_urls")
    return list(urls)


@pytest.fixture(scope="module")
def celery_config(dlock_urls: list[str]) -> dict[str, Any]:
    """Celery's in-memory broker and result store, as the sample project's conftest has."""
    return {
        "broker_url": "memory://",
        "result_backend": "cache+memory://",
        "dlock_urls": list(dlock_urls),
    }


@pytest.fixture(autouse=True)
def _fresh_gates() -> Iterator[None]:
    GATES.clear()
    yield
    for event in GATES.values():
        event.set()  # no body left blocked in the worker's threads


def define(app: Any) -> dict[str, Any]:
    """The tasks of these tests, on this test's ``celery_app`` (before its worker starts)."""

    @app.task(base=SingletonTask, bind=True, name="glue.sync", lock_key="sync:{entity}")
    def sync(self: Any, entity: str, wait_for: str = "") -> int:
        if wait_for:
            assert gate(wait_for).wait(30)
        return int(self.lease.token)

    @app.task(base=SingletonTask, bind=True, name="glue.strict", on_duplicate="raise")
    def strict(self: Any, entity: str) -> str:
        return entity

    @app.task(base=SingletonTask, bind=True, name="glue.parallel", lock_key="p:{entity}")
    def parallel(self: Any, entity: str, meet: str) -> str:
        # Both bodies must be inside at once for the barrier to open.
        barrier = BARRIERS[meet]
        barrier.wait(30)
        return entity

    @app.task(
        base=SingletonTask,
        bind=True,
        name="glue.watched",
        lock_key="w:{entity}",
        on_lock_lost="raise",
        lock_ttl=5,
    )
    def watched(self: Any, entity: str) -> str:
        gate("watched-in").set()
        assert gate("watched-lost").wait(30)
        # The key was taken away: the lease hears it at its next renewal (made to run at once
        # by dlock.lose, at the latest a third of the ttl later), and then ensure() raises.
        end = time.monotonic() + 2 * self.lock_ttl
        while time.monotonic() < end:
            self.lease.ensure()
            time.sleep(0.01)
        return "wrote after losing the key"

    @app.task(base=SingletonTask, bind=True, name="glue.flaky", lock_key="f:{entity}")
    def flaky(self: Any, entity: str) -> int:
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return int(self.request.retries)

    return {
        "sync": sync,
        "strict": strict,
        "parallel": parallel,
        "watched": watched,
        "flaky": flaky,
    }


BARRIERS: dict[str, threading.Barrier] = {}


@pytest.fixture
def tasks(celery_app: Any) -> dict[str, Any]:
    return define(celery_app)


@pytest.fixture
def worker(tasks: dict[str, Any], dlock_worker: Any) -> Any:
    return dlock_worker


def test_a_duplicate_of_a_running_task_is_dropped_naming_the_holder(
    tasks: dict[str, Any], worker: Any, dlock: Any
) -> None:
    sync = tasks["sync"]
    first = sync.delay("acme", wait_for="release-first")
    holder = dlock.wait_held(dlock.key(sync, "acme"))
    assert holder.task_id == first.id
    dropped = sync.delay("acme").get(timeout=10)
    assert dropped["dlock_dropped"] is True
    assert dropped["holder"] == first.id
    gate("release-first").set()
    assert first.get(timeout=10) >= 1
    dlock.wait_free(dlock.key(sync, "acme"))


def test_a_key_held_elsewhere_makes_a_raise_policy_task_fail_with_lock_contended(
    tasks: dict[str, Any], worker: Any, dlock: Any
) -> None:
    strict = tasks["strict"]
    dlock.hold(dlock.key(strict, "acme"), task_id="other-worker")
    with pytest.raises(LockContended) as raised:
        strict.delay("acme").get(timeout=10)
    assert raised.value.holder is not None
    assert raised.value.holder.task_id == "other-worker"


def test_two_entities_run_at_once(tasks: dict[str, Any], worker: Any) -> None:
    parallel = tasks["parallel"]
    BARRIERS["both"] = threading.Barrier(2)
    results = [parallel.delay(entity, "both") for entity in ("a", "b")]
    assert [r.get(timeout=30) for r in results] == ["a", "b"]


def test_the_worker_sends_acquired_and_released_with_the_tasks_key_token_and_id(
    tasks: dict[str, Any], worker: Any, dlock: Any
) -> None:
    seen: list[tuple[str, str, int, str]] = []

    def on_acquired(key: str, token: int, task_id: str, **_: Any) -> None:
        seen.append(("acquired", key, int(token), task_id))

    def on_released(key: str, token: int, task_id: str, **_: Any) -> None:
        seen.append(("released", key, int(token), task_id))

    lock_acquired.connect(on_acquired, weak=False)
    lock_released.connect(on_released, weak=False)
    try:
        sync = tasks["sync"]
        result = sync.delay("signals")
        token = result.get(timeout=10)
        key = dlock.key(sync, "signals")
        dlock.wait_free(key)
        dlock.wait_until(lambda: len(seen) == 2)
    finally:
        lock_acquired.disconnect(on_acquired)
        lock_released.disconnect(on_released)
    assert seen == [("acquired", key, token, result.id), ("released", key, token, result.id)]


def test_a_body_whose_key_is_taken_away_stops_with_lock_lost(
    tasks: dict[str, Any], worker: Any, dlock: Any
) -> None:
    watched = tasks["watched"]
    result = watched.delay("acme")
    assert gate("watched-in").wait(30)
    key = dlock.key(watched, "acme")
    taken_from = dlock.lose(key)
    assert taken_from.task_id == result.id
    gate("watched-lost").set()
    with pytest.raises(LockLost):
        result.get(timeout=10)


def test_a_retry_frees_the_key_and_the_retried_run_takes_it_again(
    tasks: dict[str, Any], worker: Any, dlock: Any
) -> None:
    flaky = tasks["flaky"]
    assert flaky.delay("acme").get(timeout=10) == 1
    # (had the first run kept the key, the retry would have been dropped as its duplicate)
    dlock.wait_free(dlock.key(flaky, "acme"))
