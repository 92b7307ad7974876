"""A lease on ZooKeeper: valid while its session is proven alive, not for a ttl; or, on a timed
node (:class:`NodeLease`), for its ttl."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from celery_dlock.core import forks
from celery_dlock.core.errors import LockLost
from celery_dlock.core.lease import Lease, LeaseBackend, LostCallback
from celery_dlock.core.renewal import watchdog
from celery_dlock.core.signals import lock_lost

log = logging.getLogger("celery_dlock.renew")


class ZkLease(Lease):
    """A :class:`Lease` whose validity follows the ZooKeeper session.

    A reply to a request sent at ``S`` proves the servers heard from the session at or after
    ``S``, so the session cannot expire there before ``S + session timeout``: the lease is
    valid until then, minus the drift allowance, counted from before the acquisition's create,
    and no longer than its ttl after it (``lock_ttl`` means the same on every backend). The
    watchdog "renews" it every third of the shorter of the two with one request per session,
    whatever the number of leases (:func:`celery_dlock.backends.zookeeper.holding.renew`), which
    moves that bound on for every lease of the session; a node someone deleted is reported by its
    holder's watch (:mod:`celery_dlock.backends.zookeeper.loss`). So a process paused past the
    session timeout wakes up with its lease already invalid, as on Redis. A suspended connection
    cuts the validity further (see :mod:`celery_dlock.backends.zookeeper.session`); the same session
    coming back lifts the cut.
    """

    def __init__(self, backend: LeaseBackend, path: str, **kwargs: Any) -> None:
        super().__init__(backend, **kwargs)
        #: The lease's lock node (full path).
        self.path = path
        self.pid = forks.pid()
        #: Validity proven by the session's last answered request (see the class docstring).
        self.session_until = self.deadline
        #: Where max_hold ends validity (infinite without max_hold).
        self.bound = math.inf if self.max_hold is None else self.acquired_at + self.max_hold
        #: The cut of a suspended connection, or None while connected.
        self.suspended_until: float | None = None
        self._losing = threading.Lock()
        self._recompute_deadline()

    def _recompute_deadline(self) -> None:
        """The deadline: the earliest of the session's proof, max_hold and a suspension's cut."""
        cut = math.inf if self.suspended_until is None else self.suspended_until
        self._deadline = min(self.session_until, self.bound, cut)

    def renewed(self, started: float, deadline: float) -> None:
        self.session_until = max(self.session_until, deadline)
        self.renewals += 1
        if self.renew_interval is not None:
            self.next_renewal = started + self.renew_interval
        self._recompute_deadline()

    def suspend(self, until: float) -> None:
        """The connection is gone: valid until ``until`` at most (see the session module)."""
        if self.released or self._lost is not None:
            return
        self.suspended_until = until
        self._recompute_deadline()
        watchdog.add(self)  # wakes the watchdog if the cut comes before its next look

    def resume(self) -> None:
        """The same session is back: lift the cut (unless it already ran out)."""
        if self.released or self._lost is not None or self.suspended_until is None:
            return
        if time.monotonic() >= self._deadline:
            self.lose(self._expiry_reason())
            return
        self.suspended_until = None
        self._recompute_deadline()

    def lose(self, reason: str) -> bool:
        """Report the lease lost from one of kazoo's threads (a watch, the session listener).

        The lease reads as lost at once (``lost``, ``valid_for``, ``ensure()``), but the
        ``on_lost`` callbacks and the ``lock_lost`` signal run on a thread of their own: kazoo
        delivers every watch of the process on one thread and session states on its
        connection thread, so a user callback that blocks there would stall every other
        lock's wake-ups and loss reports, or the connection itself. False if already ended.
        """
        with self._losing:
            if self._lost is not None or self.released:
                return False
            error = LockLost(
                f"lock {self.key!r} (fencing token {self.token}) was lost: {reason}",
                key=self.key,
                reason=reason,
                token=self.token,
            )
            self._lost = error
            callbacks, self._callbacks = self._callbacks, []
        teller = threading.Thread(
            target=self._tell, args=(error, callbacks), name="dlock-zk-lost", daemon=True
        )
        try:
            teller.start()
        except RuntimeError:  # the interpreter is shutting down (atexit's close_all): tell here
            self._tell(error, callbacks)
        return True

    def _tell(self, error: LockLost, callbacks: list[LostCallback]) -> None:
        """What :meth:`Lease.mark_lost` does after recording the loss: log, signal, callbacks."""
        log.warning(
            "lease lost: key=%s token=%s task_id=%s reason=%s",
            self.key,
            self.token,
            self.holder,
            error.reason,
        )
        lock_lost.send(
            sender=self.sender,
            key=self.key,
            token=self.token,
            task_id=self.holder,
            reason=error.reason,
            held_for=time.monotonic() - self.acquired_at,
        )
        for callback in callbacks:
            self._run_callback(callback, error)

    def _expiry_reason(self) -> str:
        if self.max_hold is not None and self._deadline >= self.bound:
            return f"held for its max_hold of {self.max_hold:g} s; no longer renewed"
        if self.suspended_until is not None and self._deadline >= self.suspended_until:
            return (
                "the connection to ZooKeeper was lost for longer than the session can be "
                "trusted to outlive it (the lock node may be gone)"
            )
        return (
            "no ZooKeeper server answered for longer than the session timeout allows "
            "(process paused, or the ensemble unreachable): the session may have expired"
        )


class NodeLease(ZkLease):
    """A lease on one lock node, with what :func:`celery_dlock.backends.zookeeper.timed.forget`
    needs: when the node was made, on the leader's clock (``ctime_ms``), whether the acquisition
    waited in line, and whether the node is timed (then the lease is valid for its ttl, not
    for as long as the session, and forgetting it changes nothing on the servers)."""

    def __init__(
        self, backend: Any, path: str, *, ctime_ms: int, waited: bool, timed: bool, **kwargs: Any
    ) -> None:
        self.ctime_ms = ctime_ms
        self.waited = waited
        self.timed = timed
        super().__init__(backend, path, **kwargs)

    def suspend(self, until: float) -> None:
        if not self.timed:  # a timed node does not end with the session
            super().suspend(until)

    def resume(self) -> None:
        if not self.timed:
            super().resume()

    def _expiry_reason(self) -> str:
        if self.timed:
            return f"its validity ran out (ttl {self.ttl:g} s on a timed node, not renewed)"
        return super()._expiry_reason()
