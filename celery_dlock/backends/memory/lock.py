"""Leases on an in-process lock table: :class:`MemoryBackend`, the ``Backend``
(:mod:`celery_dlock.core.backend`) of a ``memory://`` URL, for tests.

It keeps the whole contract inside one process: exclusion across threads, fencing tokens that
only rise per key, waiting in line with one waiter woken per release, a ttl and a validity on
``time.monotonic()`` (so freezegun's ``freeze_time(...).tick()`` moves a lease to its expiry),
renewal by the watchdog, loss reported. What it cannot keep it refuses: taking a key in a
process forked after the table's first use (:meth:`.store.Store.bind`), and a prefork worker of
more than one process (:func:`celery_dlock.backends.memory.check_worker`).

A wait is bounded twice: by its length on ``time.monotonic()`` (the clock a test may freeze)
and by the same length of real time, so a frozen clock cannot make it hang; and a waiter looks
at the (possibly moved) clock at least every :data:`LOOK_EVERY` seconds, so a holder's expiry
that a test ticked past is noticed without a release.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from celery_dlock.backends.memory.store import Refused, Store, Waiter
from celery_dlock.core.backend import BaseBackend
from celery_dlock.core.clock import real_clock
from celery_dlock.core.config import (
    Settings,
    check_key,
    drift,
)
from celery_dlock.core.errors import LockContended
from celery_dlock.core.holder import Holder, LockInfo, head_nonce, value_head
from celery_dlock.core.lease import Lease, LostCallback
from celery_dlock.core.renewal import announce_won, watchdog

log_acquire = logging.getLogger("celery_dlock.acquire")
log_release = logging.getLogger("celery_dlock.release")

#: Longest real time a waiter sleeps before looking at the clock again (a test may have moved
#: it past the holder's expiry or the wait's end); a release wakes the first waiter at once.
LOOK_EVERY = 0.05


def _task_name(sender: Any) -> str | None:
    name = getattr(sender, "name", None)
    return name if isinstance(name, str) else None


class MemoryBackend(BaseBackend):
    """Acquire and release leases in this process's memory (a ``memory://`` URL)."""

    #: An acquisition others can see is decided: never undone (see Backend.settle_time).
    settle_time = 0.0
    #: A lock expires ttl after its last renewal; a forced release is seen at the next one.
    expires = True
    release_seen_at_once = False
    keeps_free_fence = True

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.prefix = settings.prefix

    def __repr__(self) -> str:
        return f"<MemoryBackend {self.store.url} prefix={self.prefix!r}>"

    def _name(self, key: str) -> str:
        """The key in the table: two apps with different ``dlock_prefix`` never share a key."""
        return f"{self.prefix}:{key}"

    # -- acquire ---------------------------------------------------------------------------

    def acquire_checked(
        self,
        key: str,
        ttl: float,
        wait: float | None,
        *,
        holder: str | None,
        interval: float | None,
        max_hold: float | None = None,
        on_lost: LostCallback | None = None,
        takeover: str | None = None,
        queued: bool = False,
        sender: Any = None,
        fence_retention: float | None = None,
    ) -> Lease:
        """:meth:`acquire` for arguments already checked."""
        store = self.store
        store.bind()
        name = self._name(key)
        retention = self.settings.fence_retention if fence_retention is None else fence_retention
        task = _task_name(sender)
        begun = time.monotonic()
        real_end = None if wait is None else real_clock() + wait
        waiter: Waiter | None = None
        try:
            while True:
                head = value_head(holder, queued=queued, task=task)
                started = time.monotonic()
                outcome = store.take(
                    name,
                    head,
                    ttl,
                    started,
                    takeover=takeover,
                    retention=retention,
                    waiter=waiter,
                )
                if not isinstance(outcome, Refused):
                    break
                left = self._left(begun, wait, real_end)
                if left is not None and left <= 0:
                    raise self._contended(key, outcome)
                if waiter is None:
                    # In line from now on (take() put it there for the next refusal): try
                    # once more at once, so a release between the two calls is not missed.
                    waiter = Waiter()
                    continue
                self._sleep(waiter, outcome, left)
        finally:
            if waiter is not None:
                store.leave(name, waiter)
        token = outcome[0]
        deadline = started + ttl - drift(ttl, self.settings.drift_factor)
        lease = Lease(
            self,
            key,
            token,
            head,
            holder=holder,
            ttl=ttl,
            started=started,
            deadline=deadline,
            renew_interval=interval,
            max_hold=max_hold,
            sender=sender,
        )
        return announce_won(lease, begun, on_lost)

    @staticmethod
    def _left(begun: float, wait: float | None, real_end: float | None) -> float | None:
        """Seconds of the wait left: the less of what the (maybe frozen) monotonic clock and
        the real clock say; None for a wait without bound."""
        if wait is None or real_end is None:
            return None
        return min(begun + wait - time.monotonic(), real_end - real_clock())

    @staticmethod
    def _sleep(waiter: Waiter, refused: Refused, left: float | None) -> None:
        """Sleep until woken by a release, the holder's expiry, or the wait's end; never
        longer than :data:`LOOK_EVERY` (the clock may have been moved meanwhile)."""
        timeout = LOOK_EVERY if left is None else min(LOOK_EVERY, left)
        if refused.expires is not None:
            timeout = min(timeout, max(0.0, refused.expires - time.monotonic()))
        waiter.event.wait(timeout)
        waiter.event.clear()

    @staticmethod
    def _contended(key: str, refused: Refused) -> LockContended:
        if refused.holder is None:
            return LockContended(
                f"lock {key!r} is being handed to the next waiter in line", key=key
            )
        left = None if refused.expires is None else max(0.0, refused.expires - time.monotonic())
        return LockContended(
            f"lock {key!r} is held by {refused.holder.describe()}",
            key=key,
            holder=refused.holder,
            retry_after=left,
        )

    def send_queued(self, key: str, ttl: float, *, holder: str, sender: Any = None) -> None:
        """Nothing to send ahead in memory: the caller acquires at once instead."""

    # -- hold and end a lease ----------------------------------------------------------------

    def release(self, lease: Lease, *, wait: bool = True) -> bool:
        """Delete the lease's key if it still holds it and wake the first waiter; True if
        deleted (``wait`` changes nothing here: nothing to wait for)."""
        with lease.io_lock:
            lease.notice_expiry()
            if not lease.set_released():
                return False
            watchdog.discard(lease)
            deleted = self.store.delete(self._name(lease.key), nonce=head_nonce(lease.head))
        lease.announce_released(deleted)
        log_release.debug("released key=%s token=%s", lease.key, lease.token)
        return deleted

    def renew(self, leases: Sequence[Lease]) -> list[str | None]:
        """Extend each lease in the table: None when renewed, or why it is lost."""
        out: list[str | None] = []
        factor = self.settings.drift_factor
        for lease in leases:
            started = time.monotonic()
            reason = self.store.extend(
                self._name(lease.key), head_nonce(lease.head), lease.ttl, started
            )
            if reason is None:
                lease.renewed(started, started + lease.ttl - drift(lease.ttl, factor))
            out.append(reason)
        return out

    def hand_over(self, lease: Lease, ttl: float) -> str | None:
        """Turn ``lease`` into its own task's queued lock for ``ttl`` seconds, keeping its
        fencing token; the queued lock's nonce, or None when the lease no longer held."""
        head = value_head(lease.holder, queued=True, task=_task_name(lease.sender))
        with lease.io_lock:
            if not lease.set_released():
                return None
            watchdog.discard(lease)
            done = self.store.replace(
                self._name(lease.key), head_nonce(lease.head), head, lease.token, ttl
            )
        return head_nonce(head) if done else None

    def forget(self, lease: Lease) -> None:
        """Stop renewing ``lease`` and never release it: its key lives out its ttl."""
        lease.set_released()
        watchdog.discard(lease)

    def release_nonce(self, key: str, nonce: str) -> bool:
        """Delete ``key`` if the acquisition ``nonce`` holds it; True if deleted."""
        return self.store.delete(self._name(check_key(key)), nonce=nonce)

    def release_by_task(self, key: str, task_id: str) -> bool:
        """Delete ``key`` if the task ``task_id`` holds it, whichever acquisition."""
        return self.store.delete(self._name(check_key(key)), task_id=task_id)

    # -- operators ---------------------------------------------------------------------------

    def holder(self, key: str) -> Holder | None:
        """Who holds ``key``; None when nobody does."""
        return self.inspect(key).holder

    def inspect(self, key: str) -> LockInfo:
        """``key``'s holder, time left and fencing counter."""
        key = check_key(key)
        info = self.store.read(self._name(key))
        return LockInfo(key, info.holder, info.ttl_left, info.fence)

    def locks(self, prefix: str = "") -> list[LockInfo]:
        """Every held key starting with ``prefix``."""
        start = len(self.prefix) + 1
        return [self.inspect(name[start:]) for name in self.store.keys(self._name(prefix))]

    def force_release(self, key: str, holder: Holder) -> bool:
        """Release ``key`` from the acquisition ``holder``: its renewal reports it lost, the
        fencing counter moves on. True if it held the key."""
        return self.store.revoke(self._name(check_key(key)), holder.nonce)

    def waiting(self, key: str) -> int:
        """How many threads of this process wait in line for ``key`` (for tests)."""
        return self.store.waiting(self._name(check_key(key)))

    def endpoints(self) -> list[str]:
        """The table's URL and the process whose memory holds it."""
        owner = self.store.owner
        where = f"pid {owner}" if owner is not None else f"pid {os.getpid()}, unused yet"
        return [f"{self.store.url} (in-process, {where})"]

    def describe(self) -> str:
        """The table's URL and the process that holds it."""
        return self.endpoints()[0]

    def line(self, key: str) -> list[Holder]:
        """Empty: a waiter is a thread of this process and leaves nothing in the table."""
        return []

    def check(self) -> list[tuple[str, str | None]]:
        """The table answers in the process that owns it; elsewhere it is only a copy."""
        owner = self.store.owner
        error = None
        if owner is not None and owner != os.getpid():
            error = f"the table belongs to process {owner}; this process has only a copy"
        return [(self.endpoints()[0], error)]

    def close(self) -> None:
        """Nothing to close: the table lives as long as the process."""
