"""The per-process watchdog thread that keeps held leases alive.

One daemon thread per process renews every lease that asks for it, about every ttl/3, handing
each backend all its due leases in one call (on Redis: one compare-and-extend script call per
node, as https://redis.io/docs/latest/develop/use/distributed-locks/ extends a lock, batched). It
reports a lease lost when a node says the key is gone or taken, or when the lease's own
validity runs out before a renewal succeeds; it stops renewing after a lease's ``max_hold``.
After ``fork()`` the child starts with no leases and starts its own thread on first use: the
parent's leases stay the parent's.

Backend-neutral: it knows a lease's backend only as :class:`~celery_dlock.core.lease.LeaseBackend`.
A backend that learns some of its leases need renewing at once (Redis: a failover) says so
through :meth:`Watchdog.hurry`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery_dlock.core.background import BackgroundThread, background
from celery_dlock.core.errors import ConfigError
from celery_dlock.core.signals import lock_acquired, lock_lost

if TYPE_CHECKING:
    from celery_dlock.core.lease import Lease, LeaseBackend, LostCallback

log = logging.getLogger("celery_dlock.renew")

#: A lease due within this fraction of its interval is renewed with the current batch.
BATCH_SLACK = 0.25
#: The idle watchdog looks for new leases at least this often (seconds).
IDLE_TICK = 1.0
#: After a renewal nobody answered, retry after this fraction of the renew interval.
RETRY_FRACTION = 0.25


class Watchdog(BackgroundThread):
    """Renews leases in the background; one per process."""

    thread_name = "dlock-watchdog"

    def fresh(self) -> None:
        super().fresh()
        self._leases: set[Lease] = set()
        self._wake_at = math.inf  # when the thread will look next, if it is waiting

    def condition(self) -> threading.Condition:
        # A plain Lock under the condition: ``with self._lock`` costs no Python-level call,
        # unlike entering the Condition (add and discard run on every task).
        self._lock = threading.Lock()
        return threading.Condition(self._lock)

    def add(self, lease: Lease) -> None:
        with self._lock:
            self._leases.add(lease)
            if not self._running:
                self.start()
            # Only a lease due before the thread's next look needs waking it: most
            # acquisitions are not, and a needless wake-up costs a GIL hand-off each. This is
            # ``_due_at(lease) < self._wake_at`` without its clock read: a lease whose
            # validity ran out has its deadline before the next look already.
            wake_at = self._wake_at
            if (
                wake_at > lease.next_renewal
                or wake_at > lease.deadline
                or (wake_at > 0.0 and (lease.released or lease._lost is not None))
            ):
                self._cond.notify()

    def hurry(self, concerned: Callable[[LeaseBackend], bool]) -> None:
        """Renew now every renewed lease whose backend is ``concerned``: the backend knows its
        copies of those keys expire unless renewed at once (Redis: a node's sentinels announced
        a new master). A renewal already under way (perhaps on the old master) is followed by
        another at once."""
        now = time.monotonic()
        with self._cond:
            for lease in self._leases:
                if lease.renew_interval is not None and concerned(lease.backend):
                    lease.hurried = True
                    lease.next_renewal = min(lease.next_renewal, now)
            self._cond.notify()

    def discard(self, lease: Lease) -> None:
        with self._lock:
            self._leases.discard(lease)

    def __len__(self) -> int:
        return len(self._leases)

    def leases(self) -> list[Lease]:
        """The leases this process holds and renews now."""
        with self._cond:
            return list(self._leases)

    def loop(self, cond: threading.Condition) -> None:
        while True:
            with cond:
                if cond is not self._cond:
                    return  # forked away from under us (cannot happen in the child's thread)
                if not self._leases:
                    # Idle: look again within IDLE_TICK anyway, so that adding a lease due
                    # later than that needs no wake-up (most leases end long before renewal).
                    self._wake_at = time.monotonic() + IDLE_TICK
                    cond.wait(IDLE_TICK)
                    continue
                now = time.monotonic()
                wake = min(_due_at(lease) for lease in self._leases)
                if wake > now:
                    self._wake_at = wake
                    cond.wait(wake - now)
                    continue
                self._wake_at = -math.inf  # busy: adds need not wake us
                due = [lease for lease in self._leases if _due_at(lease) <= now + _slack(lease)]
            try:
                self._service(due)
            except Exception:  # never let the watchdog die: other leases depend on it
                log.exception("watchdog round failed")

    def _service(self, due: list[Lease]) -> None:
        now = time.monotonic()
        batches: dict[LeaseBackend, list[Lease]] = defaultdict(list)
        for lease in due:
            if lease.released:
                self.discard(lease)
            elif lease.lost:
                self._lose(lease, lease.lost_reason or "lost")
            elif lease.renew_interval is None or (
                lease.max_hold is not None and now >= lease.acquired_at + lease.max_hold
            ):
                # Not renewed (any more): nothing to do until its validity runs out.
                lease.next_renewal = lease.deadline
            else:
                batches[lease.backend].append(lease)
        for backend, leases in batches.items():
            self._renew(backend, leases)

    def _renew(self, backend: LeaseBackend, leases: list[Lease]) -> None:
        # Skip leases being released right now (their io_lock is held): renewing one could
        # re-create a key the release has just deleted.
        held = [lease for lease in leases if lease.io_lock.acquire(blocking=False)]
        try:
            live = [lease for lease in held if not lease.released]
            if not live:
                return
            for lease in live:
                lease.hurried = False
            try:
                outcomes: list[str | None] = list(backend.renew(live))
            except ConfigError as exc:
                # Found on contact (two Redlock URLs reach one server): no renewal can ever
                # succeed, so the leases are lost now, saying why.
                outcomes = [str(exc)] * len(live)
            except Exception:
                # Not retried at once: the next round would fail alike, in a busy loop.
                _retry_later(live, time.monotonic())
                raise
        finally:
            for lease in held:
                lease.io_lock.release()
        now = time.monotonic()
        for lease, reason in zip(live, outcomes, strict=True):
            if reason is not None:
                self._lose(lease, reason)
            elif lease.hurried:  # the master changed while this renewal was under way
                lease.next_renewal = now
            else:  # undecided (nodes silent): try again soon, until the validity runs out
                _retry_later([lease], now)

    def _lose(self, lease: Lease, reason: str) -> None:
        self.discard(lease)
        if lease.mark_lost(reason):
            # Free what we may still hold on some nodes, so others need not wait for expiry;
            # off this thread, so a hung node cannot delay other leases' renewals.
            background(lease.backend.release, lease)


def _retry_later(leases: list[Lease], now: float) -> None:
    """Renew ``leases`` again a fraction of their interval from ``now`` (not past validity)."""
    for lease in leases:
        if lease.next_renewal <= now and lease.renew_interval is not None:
            lease.next_renewal = min(now + lease.renew_interval * RETRY_FRACTION, lease.deadline)


def _due_at(lease: Lease) -> float:
    if lease.released or lease.lost:
        return 0.0
    return min(lease.next_renewal, lease.deadline)


def _slack(lease: Lease) -> float:
    return (lease.renew_interval or 0.0) * BATCH_SLACK


watchdog = Watchdog()


log_acquire = logging.getLogger("celery_dlock.acquire")


def announce_won(lease: Lease, begun: float, on_lost: LostCallback | None) -> Lease:
    """What a backend whose leases have a ttl does with a lease it has just won: attach
    ``on_lost``, give the lease to the watchdog when it is renewed or someone listens for its
    loss (the watchdog also reports a lease that is not renewed when its validity runs out),
    log it and send ``lock_acquired``. ``begun``: the monotonic time the acquire began."""
    if on_lost is not None:
        lease.on_lost(on_lost)
    if (
        lease.renew_interval is not None
        or lease.max_hold is not None
        or on_lost is not None
        or lock_lost.receivers
    ):
        watchdog.add(lease)
    waited = lease.acquired_at - begun
    if log_acquire.isEnabledFor(logging.DEBUG):  # what debug() asks first, one call less
        log_acquire.debug("acquired key=%s token=%s waited=%.3f", lease.key, lease.token, waited)
    if lock_acquired.receivers:  # sending costs a call and a dict even to nobody
        lock_acquired.send(
            sender=lease.sender,
            key=lease.key,
            token=lease.token,
            task_id=lease.holder,
            waited=waited,
        )
    return lease
