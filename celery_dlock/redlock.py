"""Where :class:`~celery_dlock.LockInfo` lived before the Redis backend moved to
:mod:`celery_dlock.redis`: pickles name a class by its module, so ``LockInfo`` objects pickled
by any version (a cached ``admin.locks()``, a task result) load in every other. Nothing else
lives here; the lock is :mod:`celery_dlock.redis.redlock`."""

from celery_dlock.holder import LockInfo

__all__ = ["LockInfo"]
