"""Enqueue-time mode at publish: the queued lock's acquisition is sent before Celery builds the
message and read in ``before_task_publish``. Real broker and lock servers, no worker: these are
about what a publisher sends (the worker side is in test_singleton.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_dlock import SingletonTask, enqueue
from celery_dlock.headers import HEADER_QUEUED
from celery_dlock.testing import free_port
from tests.clients import client


def publisher(
    broker: str, lock_urls: list[str], name: str, backend: str | None = "broker"
) -> tuple[Celery, Any]:
    backend = broker if backend == "broker" else backend
    app = Celery(name, broker=broker, backend=backend, set_as_current=False)
    app.conf.dlock_urls = lock_urls
    app.conf.broker_connection_retry = False
    app.conf.broker_connection_max_retries = 0
    app.conf.task_publish_retry = False

    @app.task(base=SingletonTask, shared=False, name=f"{name}.job", lock_on="enqueue")
    def job(n: int) -> int:
        return n

    return app, job


@pytest.fixture
def enqueue_app(single_urls: list[str]) -> Iterator[tuple[Celery, Any]]:
    app, job = publisher(single_urls[0], single_urls, "early")
    enqueue._held_recently.clear()  # every publish below takes the early path
    yield app, job
    app.close()


def queued_messages(app: Celery) -> list[dict[str, Any]]:
    raw = client(app.conf.broker_url).lrange("celery", 0, -1)
    return [json.loads(m) for m in raw]


def test_a_duplicate_found_at_publish_is_not_published(
    enqueue_app: tuple[Celery, Any],
) -> None:
    app, job = enqueue_app
    first = job.apply_async((1,), task_id="first")
    assert [m["headers"]["id"] for m in queued_messages(app)] == ["first"]
    # The message names its queued lock's acquisition (its token), for a worker discarding it.
    holder = job._dlock().manager.holder(job.lock_key_for((1,), {}))
    assert queued_messages(app)[0]["headers"][HEADER_QUEUED] == holder.token
    enqueue._held_recently.clear()  # so the duplicate, too, is read at publish

    duplicate = job.apply_async((1,), task_id="second")

    assert duplicate.id == first.id == "first"
    assert [m["headers"]["id"] for m in queued_messages(app)] == ["first"]
    # Celery subscribed to the called-off message's result before publishing; undone.
    assert app.backend.get_key_for_task("second") not in app.backend.result_consumer.subscribed_to


def test_a_publish_that_fails_after_the_acquisition_frees_the_key(
    single_urls: list[str],
) -> None:
    app, job = publisher(f"redis://127.0.0.1:{free_port()}/0", single_urls, "nobroker", None)
    enqueue._held_recently.clear()
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever the broker client raises
        job.delay(7)
    manager = job._dlock().manager
    assert manager.holder(job.lock_key_for((7,), {})) is None
    assert enqueue._early_locks() == {}
    app.close()


def test_lock_redis_unreachable_publishes_without_a_queued_lock(
    single_urls: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    dead = [f"redis://127.0.0.1:{free_port()}/0"]
    app, job = publisher(single_urls[0], dead, "nolock", backend=None)
    enqueue._held_recently.clear()
    with caplog.at_level(logging.WARNING, logger="celery_dlock.task"):
        result = job.delay(3)
    assert [m["headers"]["id"] for m in queued_messages(app)] == [result.id]
    assert any("published without its queued lock" in r.getMessage() for r in caplog.records)
    app.close()


def test_many_distinct_keys_each_hold_their_queued_lock(
    enqueue_app: tuple[Celery, Any],
) -> None:
    app, job = enqueue_app
    results = [job.delay(n) for n in range(50)]
    manager = job._dlock().manager
    for n, result in enumerate(results):
        holder = manager.holder(job.lock_key_for((n,), {}))
        assert holder is not None
        assert holder.queued
        assert holder.holder == result.id
    assert len(queued_messages(app)) == 50
