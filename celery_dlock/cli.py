"""The path of the ``celery.commands`` entry point (``celery_dlock.cli:dlock``): the command
lives in :mod:`celery_dlock.ops.cli`."""

from celery_dlock.ops.cli import dlock

__all__ = ["dlock"]
