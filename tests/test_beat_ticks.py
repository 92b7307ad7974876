"""Tick keys of beat sends, driven through real scheduler instances on real Redis.

No beat process here: two ``celery.beat.Scheduler`` instances stand for two beats, wrapped the
way ``beat_init`` wraps a running one, publishing to a real broker.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import crontab, schedule

from celery_dlock import SingletonTask
from celery_dlock.beat import HEADER_DUPLICATE_OF, _wrap_apply_async, tick_key, tick_slot
from celery_dlock.testing import free_port
from tests.clients import client


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


def entry_of(app: Celery, name: str, task: str, every: Any) -> ScheduleEntry:
    return ScheduleEntry(name=name, task=task, schedule=every, app=app)


def test_interval_slots_share_one_grid() -> None:
    app = Celery("slots", set_as_current=False)
    every_10 = entry_of(app, "e", "t", schedule(timedelta(seconds=10)))
    assert tick_slot(every_10, now=1005.0) == (100, 1000.0, 1010.0)
    assert tick_slot(every_10, now=1009.999) == (100, 1000.0, 1010.0)
    assert tick_slot(every_10, now=1010.0) == (101, 1010.0, 1020.0)


def test_a_crontab_catch_up_send_maps_to_the_run_it_makes_up_for() -> None:
    # A new leader working from an old schedule file sends "hourly" at 10:07: that is the
    # 10:00 run, which the old leader may already have sent at 10:00.
    app = Celery("cron", set_as_current=False)
    app.conf.timezone = "UTC"
    hourly = entry_of(app, "hourly", "t", crontab(minute=0, app=app))
    on_time = tick_slot(hourly, now=at("2026-11-22T10:00:00.300"))
    late = tick_slot(hourly, now=at("2026-11-22T10:07:30"))
    assert on_time == late
    assert on_time[1:] == (at("2026-11-22T10:00:00"), at("2026-11-22T11:00:00"))
    assert tick_slot(hourly, now=at("2026-11-22T11:00:01"))[1] == at("2026-11-22T11:00:00")
    daily = entry_of(app, "daily", "t", crontab(minute=30, hour=3, app=app))
    assert tick_slot(daily, now=at("2026-11-22T17:45:00"))[1:] == (
        at("2026-11-22T03:30:00"),
        at("2026-11-23T03:30:00"),
    )


def test_tick_keys_name_the_app_the_entry_and_the_slot() -> None:
    assert tick_key("proj", "e", 1000.0) == "beat-tick:proj:e:1970-01-01T00:16:40"
    assert tick_key("proj", "fast", 1000.25) == "beat-tick:proj:fast:1970-01-01T00:16:40.250"


@pytest.fixture
def beat_app(single_urls: list[str]) -> Iterator[Celery]:
    app = Celery("ticks", broker=single_urls[0], set_as_current=False)
    app.conf.dlock_urls = single_urls
    app.conf.broker_connection_retry_on_startup = False
    app.conf.task_publish_retry = False
    yield app
    app.close()


def two_beats(app: Celery) -> tuple[Scheduler, Scheduler]:
    beats = (Scheduler(app, lazy=True), Scheduler(app, lazy=True))
    for beat in beats:
        _wrap_apply_async(beat)
    return beats


def test_an_enqueue_mode_duplicate_send_takes_no_queued_lock(beat_app: Celery) -> None:
    @beat_app.task(base=SingletonTask, lock_on="enqueue", shared=False, name="ticks.report")
    def report() -> None: ...

    first_beat, second_beat = two_beats(beat_app)
    entry = entry_of(beat_app, "report", "ticks.report", schedule(timedelta(seconds=600)))
    manager = report._dlock().manager
    key = report.lock_key_for((), {})
    first = first_beat.apply_async(entry)
    assert manager.holder(key).holder == first.id  # the queued lock
    manager.release_by_holder(key, first.id)  # the first send ran and finished
    second = second_beat.apply_async(entry)  # the other beat, same slot
    assert second.id != first.id
    # Marked a duplicate of the first send, and no queued lock left behind for it.
    assert manager.holder(key) is None
    sent = [client(beat_app.conf.broker_url).lrange("celery", 0, -1)]
    assert any(HEADER_DUPLICATE_OF.encode() in raw for raw in sent[0])


def test_a_send_that_fails_gives_its_slot_back(single_urls: list[str]) -> None:
    app = Celery("down", broker=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False)
    app.conf.dlock_urls = single_urls
    app.conf.broker_connection_retry = False
    app.conf.broker_connection_max_retries = 0
    app.conf.task_publish_retry = False

    @app.task(base=SingletonTask, shared=False, name="down.job")
    def job() -> None: ...

    (beat, _) = two_beats(app)
    entry = entry_of(app, "job", "down.job", schedule(timedelta(seconds=600)))
    _, start, _ = tick_slot(entry)
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever the broker client raises
        beat.apply_async(entry)
    assert job._dlock().manager.holder(tick_key("down", "job", start)) is None
    app.close()


def test_a_tick_key_keeps_no_fence_counter_beyond_its_slot(beat_app: Celery) -> None:
    @beat_app.task(base=SingletonTask, shared=False, name="ticks.short")
    def short() -> None: ...

    (beat, _) = two_beats(beat_app)
    entry = entry_of(beat_app, "short", "ticks.short", schedule(timedelta(seconds=5)))
    _, start, _ = tick_slot(entry)
    beat.apply_async(entry)
    manager = short._dlock().manager
    fence = manager.redis_keys(tick_key("ticks", "short", start))[1]
    assert 0 < client(beat_app.conf.broker_url).pttl(fence) <= (5 + 1) * 1000
