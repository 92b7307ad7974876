"""Signals for metrics and logs: a lock acquired, contended, lost or released.

Celery ``Signal`` objects; connect receivers the Celery way::

    from celery_dlock import lock_lost

    @lock_lost.connect
    def alert(sender, key, token, task_id, reason, **kwargs): ...

``sender`` is the task (a ``SingletonTask`` instance) when a task holds the lock, else None.
Every signal carries ``key`` (the lock name as the user's key made it), ``token`` (the fencing
token, None when no lease was taken) and ``task_id`` (None outside tasks). Receivers run in
the thread that sent the signal (``lock_lost`` usually in the renewal watchdog's), must be
quick, and their exceptions are logged, never raised.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

lock_acquired = Signal(name="dlock_lock_acquired")
"""A lease was taken. Extra: ``waited`` (seconds spent waiting for it)."""
lock_contended = Signal(name="dlock_lock_contended")
"""The key was held by another. Extra: ``holder`` (a :class:`~celery_dlock.Holder` or None),
``policy`` (what happens now: "drop", "requeue", "raise", "wait", or "merge" when an
enqueue-time duplicate was answered with the queued task's result; from ``lock()``, "raise"
when it would not wait and "wait" when its wait ran out), and ``retry_in`` (seconds until a
requeued duplicate comes back; None for other policies)."""
lock_lost = Signal(name="dlock_lock_lost")
"""A held lease was lost. Extra: ``reason``, ``held_for`` (seconds since it was taken)."""
lock_released = Signal(name="dlock_lock_released")
"""A lease was given back. Extra: ``held_for`` (seconds), ``confirmed`` (a quorum deleted it;
None when the release was sent without waiting, as at the end of a task)."""
