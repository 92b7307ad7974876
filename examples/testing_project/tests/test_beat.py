"""Two beat processes send the same scheduled run: it runs once."""

from __future__ import annotations

from datetime import timedelta

from celery.beat import ScheduleEntry
from shop.tasks import nightly_report


def test_two_beats_run_a_scheduled_job_once_per_tick(celery_app, dlock_worker, dlock):
    entry = ScheduleEntry(
        name="nightly-report",
        task=nightly_report.name,
        schedule=timedelta(hours=24),
        app=celery_app,
    )
    beats = [dlock.beat_scheduler(celery_app), dlock.beat_scheduler(celery_app)]
    sent = [beat.apply_async(entry) for beat in beats]  # both send the same tick
    outcomes = [result.get(timeout=10) for result in sent]
    ran = [o for o in outcomes if isinstance(o, str)]
    dropped = [o for o in outcomes if isinstance(o, dict) and o.get("dlock_dropped")]
    assert len(ran) == 1
    assert len(dropped) == 1
