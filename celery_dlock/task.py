"""The path ``SingletonTask`` had before the Celery layer had a folder of its own: a dotted path
in settings (``task_cls="celery_dlock.task:SingletonTask"``) still finds it here. Import it
from :mod:`celery_dlock`."""

from celery_dlock.celery.task import SingletonTask

__all__ = ["SingletonTask"]
