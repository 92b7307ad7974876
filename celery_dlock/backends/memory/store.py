"""The lock table of one ``memory://`` URL: keys, their holders, fencing counters and waiters.

Everything lives in a dict of one process, behind one ``threading.Lock``; every operation is
one short critical section, as each Redis script is one atomic call. Times are
``time.monotonic()`` readings taken by the caller, so a test that moves that clock (freezegun's
``freeze_time(...).tick()``) moves every key's expiry with it.

A key's record is the same one-line JSON value a Redis key holds (:func:`celery_dlock.core.holder
.value_head` plus the fencing token), so holders read back as the same :class:`Holder`.

Waiters stand in line per key (first come, first served): a release, an expiry noticed or an
operator's delete wakes the first waiter only, and while anyone is in line a free key is kept
for the first of them, so a newcomer cannot take it from under the woken waiter.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from celery_dlock.core import forks
from celery_dlock.core.errors import ConfigError
from celery_dlock.core.holder import Holder, LockInfo, head_nonce, parse_value

#: Force-released acquisitions remembered per key (their renewal then reports the loss).
REVOKED_KEPT = 64


class Waiter:
    """One thread waiting in line for a key: the release that makes it first wakes it."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = threading.Event()


@dataclass
class Record:
    """A held key: the value written (``head + fence + "}"``) and when the store drops it."""

    value: str
    holder: Holder
    expires: float  # time.monotonic() reading

    @property
    def nonce(self) -> str:
        return self.holder.nonce


@dataclass
class Entry:
    """Everything the store keeps for one key."""

    record: Record | None = None
    fence: int | None = None  # the last fencing token handed out
    fence_until: float = 0.0  # the counter is dropped once unused after this (monotonic)
    line: deque[Waiter] = field(default_factory=deque)
    revoked: deque[str] = field(default_factory=deque)  # nonces an operator released


@dataclass
class Refused:
    """Why an acquisition did not take the key: who holds it, and until when."""

    holder: Holder | None  # None: free, but kept for the first waiter in line
    expires: float | None


class Store:
    """The keys of one ``memory://`` name, in this process.

    ``owner`` is the process that first took a key here: a forked child (a prefork pool
    process, say) has a copy of the table, not the table, so taking a key there would not
    exclude the parent or a sibling. :meth:`bind` refuses that with a :class:`ConfigError`.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.owner: int | None = None
        self._lock = threading.Lock()
        self._keys: dict[str, Entry] = {}
        self._swept_at = 1024  # sweep unused counters when the table doubles past this

    @property
    def url(self) -> str:
        return f"memory://{self.name}"

    def bind(self) -> None:
        """Refuse to take keys in a process other than the one that took the first."""
        pid = forks.pid()
        if self.owner is None:
            self.owner = pid
        elif self.owner != pid:
            raise ConfigError(
                f"dlock_urls {self.url!r} keeps its locks in the memory of process "
                f"{self.owner}; process {pid} (forked from it after its first lock) has only a "
                "copy, so a lock taken here would not exclude the other process. memory:// is "
                "for tests in one process (an eager task, lock(), an embedded worker, "
                "--pool solo or threads, or prefork with --concurrency 1); several processes "
                "need a real store: dlock_urls = ['redis://127.0.0.1:6379/0']."
            )

    # -- taking a key ------------------------------------------------------------------------

    def take(
        self,
        key: str,
        head: str,
        ttl: float,
        now: float,
        *,
        takeover: str | None,
        retention: float,
        waiter: Waiter | None,
    ) -> tuple[int, Holder] | Refused:
        """Take ``key`` for the acquisition ``head``: its fencing token and holder, or why
        not. A refused ``waiter`` is put in line (if not there yet), atomically with the
        refusal, so no release can pass between them unseen."""
        with self._lock:
            entry = self._keys.get(key)
            if entry is None:
                entry = self._keys[key] = Entry()
                if len(self._keys) > self._swept_at:
                    self._sweep(now)
            record = self._live(entry, now)
            if record is not None and not (
                takeover and record.holder.queued and record.holder.task_id == takeover
            ):
                return self._refuse(entry, record, waiter)
            if record is None and entry.line and entry.line[0] is not waiter:
                return self._refuse(entry, None, waiter)
            if waiter is not None and entry.line and entry.line[0] is waiter:
                entry.line.popleft()
            fence = self._next_fence(entry)
            entry.fence_until = now + retention
            value = f"{head}{fence}}}"
            holder = parse_value(value)
            assert holder is not None  # value_head always writes a readable value
            entry.record = Record(value, holder, now + ttl)
            return fence, holder

    @staticmethod
    def _refuse(entry: Entry, record: Record | None, waiter: Waiter | None) -> Refused:
        if waiter is not None and waiter not in entry.line:
            entry.line.append(waiter)
        if record is None:
            return Refused(None, None)
        return Refused(record.holder, record.expires)

    @staticmethod
    def _next_fence(entry: Entry) -> int:
        """One more than the key's last token; a new counter starts at the wall clock in
        microseconds, as a single Redis floors it, so a store made afresh (another process,
        a later test) still issues tokens above those of earlier stores."""
        if entry.fence is None:
            entry.fence = time.time_ns() // 1000
        else:
            entry.fence += 1
        return entry.fence

    def leave(self, key: str, waiter: Waiter) -> None:
        """Take ``waiter`` out of line (it took the key, gave up, or was interrupted); if it
        was first and the key is free, the next waiter is woken instead."""
        with self._lock:
            entry = self._keys.get(key)
            if entry is None or waiter not in entry.line:
                return
            first = entry.line[0] is waiter
            entry.line.remove(waiter)
            if first and entry.record is None:
                self._wake(entry)

    def _live(self, entry: Entry, now: float) -> Record | None:
        """The key's record, or None once its ttl ran out (it is dropped, a waiter woken)."""
        record = entry.record
        if record is not None and record.expires <= now:
            entry.record = record = None
            self._wake(entry)
        return record

    @staticmethod
    def _wake(entry: Entry) -> None:
        if entry.line:
            entry.line[0].event.set()

    def _sweep(self, now: float) -> None:
        """Drop keys nobody holds or waits for whose fencing counter outlived its retention."""
        for key in [
            k
            for k, e in self._keys.items()
            if self._live(e, now) is None and not e.line and e.fence_until <= now
        ]:
            del self._keys[key]
        self._swept_at = max(1024, 2 * len(self._keys))

    # -- holding and ending ------------------------------------------------------------------

    def extend(self, key: str, nonce: str, ttl: float, now: float) -> str | None:
        """Renew the acquisition ``nonce`` for ``ttl`` more: None, or why it is lost."""
        with self._lock:
            entry = self._keys.get(key)
            if entry is not None and nonce in entry.revoked:
                return "released by an operator (force_release)"
            record = None if entry is None else self._live(entry, now)
            if record is None:
                return "the key was gone from the store (its ttl ran out before the renewal)"
            if record.nonce != nonce:
                return f"the key is held by {record.holder.describe()}"
            record.expires = now + ttl
            return None

    def delete(self, key: str, *, nonce: str | None = None, task_id: str | None = None) -> bool:
        """Delete ``key`` if the acquisition ``nonce`` (or a task ``task_id``) holds it, and
        wake the first waiter; True if deleted."""
        now = time.monotonic()
        with self._lock:
            entry = self._keys.get(key)
            record = None if entry is None else self._live(entry, now)
            if entry is None or record is None:
                return False
            if nonce is not None and record.nonce != nonce:
                return False
            if task_id is not None and record.holder.task_id != task_id:
                return False
            entry.record = None
            self._wake(entry)
            return True

    def revoke(self, key: str, nonce: str) -> bool:
        """An operator's release of the acquisition ``nonce``: its renewal reports the loss,
        the fencing counter moves on. True if it held the key."""
        with self._lock:
            entry = self._keys.setdefault(key, Entry())
            if nonce not in entry.revoked:
                entry.revoked.append(nonce)
                if len(entry.revoked) > REVOKED_KEPT:
                    entry.revoked.popleft()
            record = self._live(entry, time.monotonic())
            if record is None or record.nonce != nonce:
                return False
            entry.record = None
            entry.fence = self._next_fence(entry)
            self._wake(entry)
            return True

    def replace(self, key: str, nonce: str, head: str, token: int, ttl: float) -> bool:
        """Hand the key held by ``nonce`` to the acquisition ``head`` (a queued lock), keeping
        the fencing ``token``, for ``ttl`` seconds; False if ``nonce`` no longer held it."""
        now = time.monotonic()
        with self._lock:
            entry = self._keys.get(key)
            record = None if entry is None else self._live(entry, now)
            if entry is None or record is None or record.nonce != nonce:
                return False
            value = f"{head}{token}}}"
            holder = parse_value(value)
            assert holder is not None
            entry.record = Record(value, holder, now + ttl)
            return True

    # -- reading -----------------------------------------------------------------------------

    def read(self, key: str) -> LockInfo:
        """The key's holder, time left and fencing counter."""
        now = time.monotonic()
        with self._lock:
            entry = self._keys.get(key)
            if entry is None:
                return LockInfo(key, None, None, None)
            record = self._live(entry, now)
            if record is None:
                return LockInfo(key, None, None, entry.fence)
            return LockInfo(key, record.holder, max(0.0, record.expires - now), entry.fence)

    def keys(self, prefix: str) -> list[str]:
        """Every key starting with ``prefix`` that is held now."""
        now = time.monotonic()
        with self._lock:
            return sorted(
                k for k, e in self._keys.items() if k.startswith(prefix) and self._live(e, now)
            )

    def waiting(self, key: str) -> int:
        """How many threads wait in line for ``key``."""
        with self._lock:
            entry = self._keys.get(key)
            return 0 if entry is None else len(entry.line)

    def clear(self) -> None:
        """Forget every key, counter and owner (waiters in line are woken to try again)."""
        with self._lock:
            for entry in self._keys.values():
                for waiter in entry.line:
                    waiter.event.set()
            self._keys.clear()
            self.owner = None


_stores: dict[str, Store] = {}
_stores_lock = threading.Lock()


def store(name: str) -> Store:
    """The store of ``memory://<name>`` in this process (made on first use)."""
    with _stores_lock:
        found = _stores.get(name)
        if found is None:
            found = _stores[name] = Store(name)
        return found


__all__ = ["Record", "Refused", "Store", "Waiter", "head_nonce", "store"]
