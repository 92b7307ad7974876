"""SingletonTask with real ``celery worker`` processes (prefork), single Redis and Redlock-5."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import states

from tests.workers import Journal, Worker, intervals, overlaps, use_lock_urls

pytestmark = pytest.mark.slow


@dataclass
class Mode:
    name: str
    lock_urls: list[str]
    env: dict[str, str]


def with_db(url: str, db: int) -> str:
    base = url.rsplit("/", 1)[0] if url.count("/") >= 3 else url
    return f"{base}/{db}"


@pytest.fixture(scope="session")
def celery_base(_single_session: list[str]) -> str:
    """The Redis that carries the broker (db 10), results (11), single locks (12), journal (13)."""
    return _single_session[0]


@pytest.fixture(scope="module", params=["single", "redlock5"])
def mode(request: pytest.FixtureRequest, celery_base: str) -> Mode:
    if request.param == "single":
        lock_urls = [with_db(celery_base, 12)]
    else:
        lock_urls = request.getfixturevalue("_redlock_session")
    env = {
        "DLOCK_TEST_BROKER": with_db(celery_base, 10),
        "DLOCK_TEST_BACKEND": with_db(celery_base, 11),
        "DLOCK_TEST_JOURNAL": with_db(celery_base, 13),
        "DLOCK_TEST_LOCK_URLS": ",".join(lock_urls),
    }
    return Mode(request.param, lock_urls, env)


@pytest.fixture(scope="module")
def wa(mode: Mode) -> Any:
    """The test process's copy of ``tests.worker_app``, pointed at this mode's servers."""
    import os

    os.environ.update(mode.env)
    from tests import worker_app

    worker_app.app.conf.broker_url = mode.env["DLOCK_TEST_BROKER"]
    worker_app.app.conf.result_backend = mode.env["DLOCK_TEST_BACKEND"]
    use_lock_urls(worker_app.app, mode.lock_urls)
    return worker_app


@pytest.fixture
def journal(mode: Mode) -> Journal:
    journal = Journal(mode.env["DLOCK_TEST_JOURNAL"])
    journal.clear()
    for url in mode.lock_urls:
        redis.Redis.from_url(url).flushdb()
    return journal


@pytest.fixture(scope="module")
def worker(mode: Mode, wa: Any) -> Iterator[Worker]:
    journal = Journal(mode.env["DLOCK_TEST_JOURNAL"])
    started = Worker(mode.env, journal, name=f"main-{mode.name}").start()
    yield started
    started.stop()


def submit_concurrently(fn: Any, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` for every call at once from threads; results in order."""
    results: list[Any] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def go(i: int) -> None:
        barrier.wait()
        args, kwargs = calls[i]
        results[i] = fn(*args, **kwargs)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


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


def test_different_keys_run_in_parallel(wa: Any, worker: Worker, journal: Journal) -> None:
    a = wa.collect.delay("a", "x", secs=1.0)
    b = wa.collect.delay("a", "y", secs=1.0)
    assert {a.get(timeout=10), b.get(timeout=10)} == {"a:x", "a:y"}
    spans = intervals(journal.entries())
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
    for url in mode.lock_urls:
        redis.Redis.from_url(url).delete(f"dlock:{{{start['key']}}}")
    deleted_at = time.monotonic()
    with pytest.raises(Exception, match="was lost") as info:
        result.get(timeout=10)
    assert type(info.value).__name__ == "LockLost"
    assert "gone" in str(info.value)
    assert result.state == states.FAILURE
    lost = journal.wait_for("lost", id=result.id)
    assert lost[0]["t"] - deleted_at < 0.5 + 0.3  # renew interval is ttl/3 = 0.5 s
    assert journal.select("end", name="lossy") == [], "the body ran on after losing its lease"


# -- enqueue-time mode -------------------------------------------------------------------------


def test_enqueue_mode_returns_the_queued_task_to_duplicates(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    results = submit_concurrently(wa.enqueued.delay, [(("queued", 1.5), {})] * 50)
    assert len({r.id for r in results}) == 1
    by_name = wa.app.send_task("tests.worker_app.enqueued", ("queued", 1.5))
    assert by_name.id != results[0].id
    assert results[0].get(timeout=10) == "queued"
    dropped = by_name.get(timeout=10)
    assert dropped["dlock_dropped"] is True
    assert dropped["holder"] == results[0].id
    assert len(journal.select("start", name="queued")) == 1


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


def test_enqueue_mode_retry_with_countdown_keeps_the_key(
    wa: Any, worker: Worker, journal: Journal
) -> None:
    result = wa.enqueued_flaky.delay("kept", 2.0)
    journal.wait_for("end", name="kept")
    # During the countdown the key belongs to the retry message: duplicates map to it.
    assert wa.enqueued_flaky.delay("kept", 2.0).id == result.id
    assert result.get(timeout=15) == 1
    assert [s["retries"] for s in journal.select("start", name="kept")] == [0, 1]


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
