"""Where :class:`~celery_dlock.Holder` and :class:`~celery_dlock.LockInfo` lived before
:mod:`celery_dlock.core` held them: pickles name a class by its module, so ``Holder`` is still
defined under this name (its ``__module__``) and importable from here. Import them from
:mod:`celery_dlock`."""

from celery_dlock.core.holder import Holder, LockInfo

__all__ = ["Holder", "LockInfo"]
