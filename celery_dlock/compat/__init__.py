"""Drop-in replacements for celery-singleton and celery-once, on celery_dlock's locks.

Change the import and keep the code and the settings::

    from celery_dlock.compat import DuplicateTaskError, Singleton, clear_locks  # celery_singleton
    from celery_dlock.compat import AlreadyQueued, QueueOnce  # was celery_once

Both classes are :class:`celery_dlock.SingletonTask` in enqueue-time mode
(``lock_on="enqueue"``): the key is taken when the task is published, passes to its execution,
is renewed while the body runs and is released on success, failure, retry, revoke and warm
shutdown; a crashed worker's key expires ``lock_ttl`` after its last renewal. The peers' task
options, per-call options, app settings, exceptions, helpers and return values are read as the
peers read them; where the peers' behaviour is a fault (a key held for ever after a crash, a
retry that never runs, two keys for one call, ``send_task`` not deduplicated) these classes do
what ``SingletonTask`` does instead. docs/migrating.md lists every option and every difference.
"""

from __future__ import annotations

from celery_dlock.compat.once import AlreadyQueued, QueueOnce
from celery_dlock.compat.singleton import DuplicateTaskError, Singleton, clear_locks

__all__ = ["AlreadyQueued", "DuplicateTaskError", "QueueOnce", "Singleton", "clear_locks"]
