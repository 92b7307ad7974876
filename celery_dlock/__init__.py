"""celery_dlock: Celery tasks that run one at a time, per task or per resource, cluster-wide.

Public names are the ones imported here; everything else is internal.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from celery_dlock import admin
from celery_dlock.celery import beat as _beat  # noqa: F401  (connects the beat_init receiver)
from celery_dlock.celery import broker as _broker  # noqa: F401  (the broker URL as lock URLs)
from celery_dlock.celery import hooks as _hooks  # noqa: F401  (connects the Celery signal receivers)
from celery_dlock.celery.task import SingletonTask
from celery_dlock.compat import options as _peer_options  # noqa: F401  (refused by SingletonTask)
from celery_dlock.core.config import DLockConfigWarning
from celery_dlock.core.guard import LockGuard, lock
from celery_dlock.core.lease import Lease
from celery_dlock.core.signals import lock_acquired, lock_contended, lock_lost, lock_released

# Through the modules whose names the classes keep for pickles and Celery's serialized
# exceptions: Celery rebuilds an exception from ``exc_module`` only if that module is loaded.
from celery_dlock.errors import (
    ConfigError,
    DLockError,
    LockContended,
    LockLost,
    LockUnavailable,
)
from celery_dlock.holder import Holder
from celery_dlock.redlock import LockInfo

try:
    __version__ = version("celery-dlock")
    """The installed distribution's version; ``"0+unknown"`` in a source tree never installed."""
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "ConfigError",
    "DLockConfigWarning",
    "DLockError",
    "Holder",
    "Lease",
    "LockContended",
    "LockGuard",
    "LockInfo",
    "LockLost",
    "LockUnavailable",
    "SingletonTask",
    "__version__",
    "admin",
    "lock",
    "lock_acquired",
    "lock_contended",
    "lock_lost",
    "lock_released",
]
