"""Tick keys of beat sends, driven through real scheduler instances on real Redis.

No beat process here: two ``celery.beat.Scheduler`` instances stand for two beats, wrapped the
way ``beat_init`` wraps a running one, publishing to a real broker.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import crontab, schedule

from celery_dlock import SingletonTask
from celery_dlock.celery.beat import (
    _wrap_apply_async,
    tick_gap,
    tick_key,
    tick_margin,
    tick_slot,
)
from celery_dlock.celery.headers import HEADER_DUPLICATE_OF
from celery_dlock.testing import free_port
from tests.support.clients import client


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


def test_tick_keys_name_the_app_and_the_entry() -> None:
    assert tick_key("proj", "e") == "beat-tick:proj:e"


def local(zone: str, text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(zone)).timestamp()


def zoned_app(zone: str) -> Celery:
    app = Celery("zoned", set_as_current=False)
    app.conf.timezone = zone
    return app


def test_crontab_fields_are_read_in_the_apps_timezone() -> None:
    # The review's case: Asia/Tokyo, every minute of 05:xx and 06:xx. Celery before 5.7 read
    # the fields in the timezone of the datetime it was given, and only for today's date.
    app = zoned_app("Asia/Tokyo")
    entry = entry_of(app, "tokyo", "t", crontab(minute="*", hour="5,6", app=app))
    at_5 = local("Asia/Tokyo", "2026-11-22T05:00:00.300")
    minute = (
        local("Asia/Tokyo", "2026-11-22T05:00:00"),
        local("Asia/Tokyo", "2026-11-22T05:01:00"),
    )
    assert tick_slot(entry, now=at_5)[1:] == minute
    assert tick_gap(entry, now=at_5) == pytest.approx(59.7)
    last = local("Asia/Tokyo", "2026-11-22T06:59:00.300")
    assert tick_slot(entry, now=last)[2] == local("Asia/Tokyo", "2026-11-23T05:00:00")
    before = local("Asia/Tokyo", "2026-11-22T04:59:00")  # the previous run: 06:59 yesterday
    assert tick_slot(entry, now=before)[1] == local("Asia/Tokyo", "2026-11-21T06:59:00")
    # Every minute of the two hours is a slot of its own: 120 sends, 120 distinct slots.
    minutes = {tick_slot(entry, now=at_5 + 60 * n)[0] for n in range(120)}
    assert len(minutes) == 120


def test_a_daily_crontab_across_daylight_saving_changes() -> None:
    app = zoned_app("Europe/Berlin")
    entry = entry_of(app, "daily", "t", crontab(minute=30, hour=2, app=app))
    # The review's case: the slot of a 02:30 send started at 03:30 the day before.
    evening = local("Europe/Berlin", "2026-11-22T02:45:00")
    assert tick_slot(entry, now=evening)[1] == local("Europe/Berlin", "2026-11-22T02:30:00")
    # Autumn: 02:30 happens twice on 2026-10-25; the run is the first, the next day's is 25 h
    # later (the gap is real seconds, not wall-clock ones).
    first = datetime(2026, 10, 25, 0, 30, tzinfo=timezone.utc).timestamp()  # 02:30 CEST
    assert tick_slot(entry, now=first + 0.5)[1] == first
    assert tick_gap(entry, now=first + 0.5) == pytest.approx(25 * 3600 - 0.5)
    second = first + 3600  # 02:30 CET, the same wall-clock time again: the same run
    assert tick_slot(entry, now=second)[1] == first
    # Spring: 02:30 does not exist on 2026-03-29; that day's run comes at 03:30 CEST (01:30
    # UTC), and the one after 23 h later.
    spring = datetime(2026, 3, 29, 1, 30, tzinfo=timezone.utc).timestamp()
    assert tick_slot(entry, now=spring - 7200)[2] == spring  # (within the hour before it, a
    # send on Celery before 5.7 is that run's early one: see the spring-forward test below)
    assert tick_gap(entry, now=spring) == pytest.approx(23 * 3600)


def celery_sends_next(every: Any, clock: list[datetime], last: datetime) -> datetime:
    """When this Celery's beat sends the run after ``last``: its own ``is_due``, stepped a
    minute at a time on the schedule's clock (``nowfun``)."""
    zone = last.tzinfo
    utc = last.astimezone(timezone.utc)  # steps of real time: aware arithmetic is wall-clock
    while True:
        utc += timedelta(minutes=1)
        clock[0] = utc.astimezone(zone)
        if every.is_due(last).is_due:
            return clock[0]


def test_the_spring_forward_days_run_gets_a_slot_of_its_own() -> None:
    # Europe/Berlin, daily 02:30: 02:30 does not exist on 2026-03-29. Whenever this Celery
    # sends that day's run (5.7: 03:30 CEST; 5.3 to 5.6: 03:00 CEST, early by the shift), it
    # must not fall in the slot of the day before, whose tick key lives until 03:30: the
    # day's only run would be dropped as a duplicate.
    app = zoned_app("Europe/Berlin")
    last = datetime(2026, 3, 28, 2, 30, tzinfo=ZoneInfo("Europe/Berlin"))
    clock = [last]
    every_day = crontab(minute=30, hour=2, app=app, nowfun=lambda: clock[0])
    entry = entry_of(app, "daily", "t", every_day)
    sent = celery_sends_next(every_day, clock, last)
    assert sent.date() == last.date() + timedelta(days=1), sent
    assert (
        tick_slot(entry, now=sent.timestamp() + 0.3)[0]
        != tick_slot(entry, now=last.timestamp() + 0.3)[0]
    ), sent


def test_tick_gaps_and_margins() -> None:
    app = Celery("gaps", set_as_current=False)
    every_6 = entry_of(app, "e", "t", schedule(timedelta(seconds=6)))
    assert tick_gap(every_6, now=1003.5) == 6.0  # a beat's next send comes a period later
    assert tick_margin(6.0) == 1.0
    assert tick_margin(1.0) == 0.25  # short gaps: a quarter of the gap


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
    assert manager.holder(key).task_id == first.id  # the queued lock
    manager.release_by_task(key, first.id)  # the first send ran and finished
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
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever the broker client raises
        beat.apply_async(entry)
    assert job._dlock().manager.holder(tick_key("down", "job")) is None
    app.close()


def test_a_tick_key_keeps_no_fence_counter_beyond_its_slot(beat_app: Celery) -> None:
    @beat_app.task(base=SingletonTask, shared=False, name="ticks.short")
    def short() -> None: ...

    (beat, _) = two_beats(beat_app)
    entry = entry_of(beat_app, "short", "ticks.short", schedule(timedelta(seconds=5)))
    beat.apply_async(entry)
    manager = short._dlock().manager
    lock_key, fence = manager.redis_keys(tick_key("ticks", "short"))[:2]
    redis = client(beat_app.conf.broker_url)
    # Both live until the entry's next run less the margin: 5 s - 1 s, by Redis's clock.
    assert 3000 < redis.pttl(lock_key) <= 4000
    assert 0 < redis.pttl(fence) <= 4000
