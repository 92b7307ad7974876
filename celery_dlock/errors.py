"""Where the exceptions lived before :mod:`celery_dlock.core` held them: pickles and Celery's
serialized exceptions name a class by its module (``celery_dlock.errors.LockLost``), so they
are still defined under this name (their ``__module__``) and importable from here. Import them
from :mod:`celery_dlock`."""

from celery_dlock.core.errors import (
    ConfigError,
    DLockError,
    LockContended,
    LockLost,
    LockUnavailable,
)

__all__ = ["ConfigError", "DLockError", "LockContended", "LockLost", "LockUnavailable"]
