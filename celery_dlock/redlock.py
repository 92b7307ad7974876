"""Where :class:`~celery_dlock.LockInfo` lived before the Redis backend had a folder of its own:
pickles name a class by its module, so ``LockInfo`` objects pickled by any version (a cached
``admin.locks()``, a task result) load in every other. Nothing else lives here; the Redis lock
is :mod:`celery_dlock.backends.redis.redlock`."""

from celery_dlock.core.holder import LockInfo

__all__ = ["LockInfo"]
