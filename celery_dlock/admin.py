"""The operator's powers from Python (``celery_dlock.admin.locks(app)`` ...), the public path of
:mod:`celery_dlock.ops.admin`, where they are defined."""

from celery_dlock.ops.admin import (
    CheckReport,
    LockInfo,
    check,
    locks,
    node_errors,
    purge,
    release,
    show,
)

__all__ = ["CheckReport", "LockInfo", "check", "locks", "node_errors", "purge", "release", "show"]
