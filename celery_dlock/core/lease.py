"""A held lock: its fencing token, how long it stays valid, and whether it was lost.

Validity is kept on ``time.monotonic()``, counted from *before* the acquire or renew request was
sent, minus the clock-drift allowance, as Redlock computes a lock's validity
(https://redis.io/docs/latest/develop/use/distributed-locks/). So the holder's view always ends
before the backend's own expiry, and a wall-clock jump changes nothing: the holder stops
believing it holds the key before anyone else can be given it. :meth:`Lease.ensure` is the
check to make right before touching the protected resource.

A lease knows the backend that issued it only through :class:`LeaseBackend` (the two calls it
and the watchdog make), so this module imports no backend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Protocol

from celery_dlock.core.errors import LockLost
from celery_dlock.core.signals import lock_lost, lock_released

log = logging.getLogger("celery_dlock.renew")

#: Called once when a lease is lost, from the thread that noticed (usually the watchdog).
LostCallback = Callable[["Lease", LockLost], None]


class LeaseBackend(Protocol):
    """What a lease and the watchdog ask of the backend that issued the lease.

    A part of :class:`celery_dlock.core.backend.Backend` (which states the semantics), named here
    so that the lease core needs no backend module.
    """

    def release(self, lease: Lease, *, wait: bool = True) -> bool: ...

    def renew(self, leases: Sequence[Lease]) -> list[str | None]: ...


class Lease:
    """One acquisition of a key, alive until released, expired, or found taken."""

    #: Called by ensure() as it reports the loss, with this lease (set by a task body's run).
    _told: Callable[[Lease], None] | None = None

    def __init__(
        self,
        manager: LeaseBackend,  # the name it always had: callers may pass it by keyword
        key: str,
        token: int,
        head: str,
        *,
        holder: str | None,
        ttl: float,
        started: float,
        deadline: float,
        renew_interval: float | None,
        max_hold: float | None,
        sender: Any = None,
    ) -> None:
        #: The key as the caller named it, before any prefix.
        self.key = key
        #: Fencing token: strictly greater than every earlier token for this key.
        self.token = token
        #: The holder id written into the lock value (a task id), if any.
        self.holder = holder
        #: Lease length in seconds; renewals extend it to this again.
        self.ttl = ttl
        #: Seconds between renewals, or None when the lease is not renewed.
        self.renew_interval = renew_interval
        #: Longest total time this lease may be renewed for, or None for no bound.
        self.max_hold = max_hold
        self.acquired_at = started
        #: Who the signals name as sender: the task holding this lease, or None.
        self.sender = sender
        #: The backend that issued this lease: it renews and releases it.
        self.backend = manager
        self._head = head
        self._deadline = deadline
        self._lost: LockLost | None = None
        self._released = False
        self._given_back = False
        self._callbacks: list[LostCallback] = []
        # Held while a renewal or the release talks to the backend about this lease, so a renewal
        # in flight can never re-create a key the release has just deleted.
        self.io_lock = threading.Lock()
        self.next_renewal = started + renew_interval if renew_interval else deadline
        self.renewals = 0
        #: Set when the lease's node announced a new master: renew again at once.
        self.hurried = False

    # -- state -----------------------------------------------------------------------------

    @property
    def head(self) -> str:
        return self._head

    @property
    def deadline(self) -> float:
        """The ``time.monotonic()`` reading at which this lease stops being valid."""
        return self._deadline

    @property
    def valid_for(self) -> float:
        """Seconds of validity left on the monotonic clock; 0 once lost or released."""
        if self._lost is not None or self._released:
            return 0.0
        return max(0.0, self._deadline - time.monotonic())

    @property
    def lost(self) -> bool:
        """True once the lease is known lost, or its validity has run out (even unnoticed)."""
        if self._given_back:  # released at the holder's own request: ended, not lost
            return self._lost is not None
        return self._lost is not None or time.monotonic() >= self._deadline

    @property
    def released(self) -> bool:
        return self._released

    @property
    def lost_reason(self) -> str | None:
        if self._lost is not None:
            return self._lost.reason
        if time.monotonic() >= self._deadline:
            return self._expiry_reason()
        return None

    def _expiry_reason(self) -> str:
        if self.max_hold is not None and self._deadline >= self.acquired_at + self.max_hold:
            return f"held for its max_hold of {self.max_hold:g} s; no longer renewed"
        if self.renew_interval is None and self.max_hold is None:
            return f"its validity ran out (ttl {self.ttl:g} s, not renewed)"
        return (
            "its validity ran out on the monotonic clock before a renewal succeeded "
            "(process paused, or the lock store unreachable)"
        )

    def ensure(self) -> None:
        """Raise :class:`LockLost` unless the lease is still held and valid right now."""
        if self._lost is None and not self._released and time.monotonic() < self._deadline:
            return
        # The caller hears of the loss here: whoever must know it does (a task body's interrupt).
        if self._told is not None:
            self._told(self)
        if self._lost is not None:
            raise self._lost
        if self._released:
            raise LockLost(
                f"lock {self.key!r} was released", key=self.key, reason="released", token=self.token
            )
        self.mark_lost(self._expiry_reason())
        assert self._lost is not None
        raise self._lost

    def on_lost(self, callback: LostCallback) -> None:
        """Call ``callback(lease, error)`` once when the lease is lost (now if it already is)."""
        if self._lost is not None:
            self._run_callback(callback, self._lost)
        else:
            self._callbacks.append(callback)

    # -- transitions (the watchdog and the manager call these) -----------------------------

    def renewed(self, started: float, deadline: float) -> None:
        self._deadline = max(self._deadline, deadline)
        self.renewals += 1
        if self.renew_interval is not None:
            self.next_renewal = started + self.renew_interval

    def announce_released(self, confirmed: bool | None) -> None:
        """Send :data:`lock_released` for this lease (the backends' release paths call it);
        nothing to build when nobody listens."""
        if lock_released.receivers:
            lock_released.send(
                sender=self.sender,
                key=self.key,
                token=self.token,
                task_id=self.holder,
                held_for=time.monotonic() - self.acquired_at,
                confirmed=confirmed,
            )

    def mark_lost(self, reason: str) -> bool:
        """Record the loss and run the callbacks; False if it was already lost or released."""
        if self._lost is not None or self._released:
            return False
        error = LockLost(
            f"lock {self.key!r} (fencing token {self.token}) was lost: {reason}",
            key=self.key,
            reason=reason,
            token=self.token,
        )
        self._lost = error
        log.warning(
            "lease lost: key=%s token=%s task_id=%s reason=%s",
            self.key,
            self.token,
            self.holder,
            reason,
        )
        lock_lost.send(
            sender=self.sender,
            key=self.key,
            token=self.token,
            task_id=self.holder,
            reason=reason,
            held_for=time.monotonic() - self.acquired_at,
        )
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self._run_callback(callback, error)
        return True

    def _run_callback(self, callback: LostCallback, error: LockLost) -> None:
        try:
            callback(self, error)
        except Exception:
            log.exception("lost-lease callback %r failed for key %s", callback, self.key)

    def notice_expiry(self) -> None:
        """Record a loss only the clock knows of (validity ran out, the watchdog not there
        yet): a holder that ends just then still has it reported, whichever thread runs first."""
        if self._lost is None and not self._released and time.monotonic() >= self._deadline:
            self.mark_lost(self._expiry_reason())

    def release(self, *, wait: bool = True) -> bool:
        """Give the lock back; True if a quorum confirmed the delete. Idempotent, never raises
        on backend errors (the key then expires after at most the ttl). ``wait=False`` sends the
        release without waiting for the nodes' replies (and returns False)."""
        return self.backend.release(self, wait=wait)

    def give_back(self) -> bool:
        """Release now, at the holder's own request (a body freeing its key early, to queue
        its next run, say): the lease is released, never reported lost, and the body goes on
        without it. True if a quorum confirmed the delete."""
        if self._lost is not None or self._released:
            return False
        if time.monotonic() >= self._deadline:
            self.notice_expiry()
            return False
        self._given_back = True
        return self.release()

    def _release_for(self, reason: str) -> None:
        """Give the lock back for good, and report the lease lost (``reason``) from now on.

        For a body that handed its key away and might still go on, such as a retry Celery has
        just published: ``lost`` turns True and ``ensure()`` raises, without the ``on_lost``
        callbacks or the ``lock_lost`` signal (nothing was taken from it).
        """
        self.release()
        if self._lost is None:
            self._lost = LockLost(
                f"lock {self.key!r} (fencing token {self.token}) was released: {reason}",
                key=self.key,
                reason=reason,
                token=self.token,
            )

    def set_released(self) -> bool:
        """Mark released; False if it already was."""
        if self._released:
            return False
        self._released = True
        self._callbacks = []
        return True

    # -- context manager -------------------------------------------------------------------

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        was_lost = self.lost
        self.release()
        if was_lost and exc_type is None:
            # The block finished, but not necessarily alone: tell the caller.
            self.ensure_lost_error()

    def ensure_lost_error(self) -> None:
        if self._lost is None:
            self._lost = LockLost(
                f"lock {self.key!r} (fencing token {self.token}) was lost: {self._expiry_reason()}",
                key=self.key,
                reason=self._expiry_reason(),
                token=self.token,
            )
        raise self._lost

    def __repr__(self) -> str:
        state = "released" if self._released else ("lost" if self.lost else "held")
        return f"<Lease {self.key!r} token={self.token} {state} valid_for={self.valid_for:.3f}>"
