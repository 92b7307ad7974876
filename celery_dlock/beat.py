"""The path users give Celery beat (``-S celery_dlock.beat:LeaderScheduler``, the
``celery.beat_schedulers`` entry point): the scheduler lives in :mod:`celery_dlock.celery.beat`."""

from celery_dlock.celery.beat import LeaderScheduler

__all__ = ["LeaderScheduler"]
