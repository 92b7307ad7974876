"""The seam between the lease core and a lock store: what every backend must offer and keep.

:class:`Backend` lists what the lease core, :func:`celery_dlock.lock`, ``SingletonTask``, beat,
the operator functions (:mod:`celery_dlock.ops.admin`, ``celery dlock``) and the compat layers call.
Each backend under :mod:`celery_dlock.backends` implements it (Redis: one server, a Cluster, or
Redlock over N masters; ZooKeeper; the in-process one for tests) and keeps these promises:

**Fencing.** Every lease carries a fencing token (:attr:`Lease.token`, an int) strictly greater
than every token handed out earlier for the same key, for as long as the key's history is kept
(``dlock_fence_retention`` after its last use; a per-acquisition ``fence_retention`` may shorten
it for one-shot keys). A resource guarded by the lock rejects writes carrying a smaller token
than one it has seen, which is what makes a lock safe against a holder that paused past its
lease (Kleppmann, "How to do distributed locking",
https://martin.kleppmann.com/2016/02/08/how-to-do-distributed-locking.html).

**Validity.** :attr:`Lease.valid_for` is the time the holder may still act as the only holder,
on the local monotonic clock: counted from *before* the acquire (or renewal) request was sent,
for ``ttl`` minus the clock-drift allowance (``ttl * dlock_drift_factor`` plus a small constant,
:func:`celery_dlock.core.config.drift`). The store must keep the key at least ``ttl`` after it
received the request, so the holder's view always ends first; a wall-clock jump changes nothing.
A backend calls :meth:`Lease.renewed` with the new deadline when a renewal succeeds.

**Waiting.** ``wait=0`` refuses at once with :class:`LockContended` (naming the holder when it
can be read), ``wait=s`` waits up to ``s`` seconds, ``wait=None`` without bound. A waiter is woken
by the holder's release (not by polling), one waiter per release, roughly in arrival order;
a crashed holder's expiry bounds every wait. Too few reachable nodes (no quorum) raise
:class:`LockUnavailable`, never a guess.

**Release.** Only the acquisition that holds the key can extend or delete it: release and
renewal match the acquisition's random nonce (:attr:`Holder.nonce`), never the task id alone.
The two exceptions are named: :meth:`Backend.release_nonce` (a known acquisition's nonce, by
someone who knows it ended) and :meth:`Backend.release_by_task` / :meth:`Backend.force_release`
(operators, one-shot keys). A forced release must stop the holder's next renewal from bringing
the key back, and moves the fencing counter on.

**Renewal.** :meth:`Backend.renew` takes a batch of its own leases (the watchdog groups them per
backend) and returns, per lease, ``None`` when renewed *or undecided* (the store did not answer;
the watchdog retries until the lease's validity runs out), or the reason the lease is lost (a
sentence for logs and :class:`LockLost`). It never raises for an unreachable store.

A backend that learns some of its leases must be renewed at once (Redis: a failover to a new
master) calls :meth:`celery_dlock.core.renewal.Watchdog.hurry`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from enum import Enum
from typing import Any, Literal, Protocol

from celery_dlock.core.clock import jitter
from celery_dlock.core.config import (
    Settings,
    check_key,
    check_renew_interval,
    check_seconds,
    check_ttl,
)
from celery_dlock.core.errors import ConfigError, LockContended, LockUnavailable
from celery_dlock.core.holder import Holder, LockInfo
from celery_dlock.core.lease import Lease, LeaseBackend, LostCallback


class PendingLease(Protocol):
    """An acquisition sent by :meth:`Backend.send_queued` whose reply is not read yet."""

    key: str

    @property
    def nonce(self) -> str:
        """The random nonce of the acquisition sent (whether or not it took the key)."""
        ...

    def finish(self) -> Lease:
        """Read the reply: the lease, or raise :class:`LockContended` / :class:`LockUnavailable`."""
        ...


class TaskResults(Protocol):
    """What a backend may ask the task queue about the task of a queued holder while it
    confirms that holder (:meth:`Backend.duplicate_of`): the Celery layer's result backend."""

    def kept(self) -> bool:
        """Whether a caller can wait on a holder's task id: its results are kept where any
        publisher can read them."""
        ...

    def ran(self, task_id: str | None) -> bool:
        """Whether the task ``task_id`` was published and ran (its result state left PENDING)."""
        ...


class Again(Enum):
    """:meth:`Backend.duplicate_of`'s answer "try to take the queued lock again"."""

    LOOK = "look again"


#: Try the queued lock again (see :meth:`Backend.duplicate_of`).
LOOK_AGAIN: Literal[Again.LOOK] = Again.LOOK

#: Looks again (at random delays up to 10 ms times the look's number) when a queued lock's
#: acquisition was refused with no holder named (contenders collided, or the key was being
#: handed to the next in line), on top of the acquire's own retries.
UNNAMED_RETRIES = 10


class Backend(LeaseBackend, Protocol):
    """A lock store: acquire, renew and release leases; read and repair locks for operators."""

    #: The ``dlock_*`` settings this backend was made from (ttl, drift factor, timeouts...).
    settings: Settings

    #: Seconds after an acquisition's value was written (:attr:`Holder.since`) during which
    #: its acquirer may still undo it although others already read it as the holder: Redlock,
    #: where an attempt that took a majority can miss a reply, see none, and undo. 0 where an
    #: acquisition others can see is decided (one Redis, ZooKeeper). Enqueue-time duplicates
    #: merge into a younger queued holder only once it has settled.
    settle_time: float

    #: False where a lock has no ttl and lasts as long as its holder's session (ZooKeeper):
    #: an operator's listing then shows no time left for it.
    expires: bool

    #: True where a holder watches its lock and learns of a forced release at once
    #: (ZooKeeper), rather than at its next renewal.
    release_seen_at_once: bool

    #: True where a free key's fencing counter is kept (``dlock_fence_retention``), so an
    #: operator can read the last token issued; False where a key's tokens start afresh from
    #: its parent node's creation time and nothing is kept for a free key (ZooKeeper).
    keeps_free_fence: bool

    # -- acquire -----------------------------------------------------------------------------

    def acquire(
        self,
        key: str,
        *,
        ttl: float | None = None,
        wait: float | None = 0.0,
        holder: str | None = None,
        renew: bool = True,
        renew_interval: float | None = None,
        max_hold: float | None = None,
        on_lost: LostCallback | None = None,
        takeover: str | None = None,
        queued: bool = False,
        sender: Any = None,
        fence_retention: float | None = None,
    ) -> Lease:
        """Take ``key``, checking every argument; see :meth:`LockManager.acquire`."""
        ...

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
        """:meth:`acquire` for arguments already checked (a task checks its options once)."""
        ...

    def send_queued(
        self, key: str, ttl: float, *, holder: str, sender: Any = None
    ) -> PendingLease | None:
        """Send a queued lock's acquisition without waiting for the reply; None when this
        backend (or this node set) cannot, and the caller should :meth:`acquire` instead."""
        ...

    # -- end a lease -------------------------------------------------------------------------

    def duplicate_of(
        self, key: str, refusal: LockContended, looks: dict[str, int], results: TaskResults
    ) -> Holder | Literal[Again.LOOK] | None:
        """What a publish whose queued lock on ``key`` was refused (``refusal``) merges into.

        The holder to merge into (a duplicate of its task; one whose ``task_id`` is None is
        not a task: publish anyway); None when nobody can be named and there is an expiry to
        wait for (publish without the queued lock); :data:`LOOK_AGAIN` to try the queued lock
        again (no holder named yet, or the holder may still be undone). Raises
        :class:`LockUnavailable`, its message saying why, when no holder can be confirmed:
        the caller publishes without its queued lock and logs why. ``looks`` is this
        publish's count of looks again, by reason (the backend's own; empty at first).

        Merges at once where an acquisition others can read is decided (:attr:`settle_time`
        0). On Redlock an attempt that took a majority can miss a reply and undo itself, and
        its task id is then never published: a queued holder younger than ``settle_time`` is
        read again until it can no longer be undone (``results`` says whether its task ran),
        where the task's results are kept (``results.kept()``).
        """
        ...

    def release(self, lease: Lease, *, wait: bool = True) -> bool:
        """Give the lease back; True if the store confirmed. Idempotent; never raises for an
        unreachable store (the key then expires). ``wait=False`` does not wait for the
        confirmation (returns False)."""
        ...

    def renew(self, leases: Sequence[Lease]) -> list[str | None]:
        """Extend each lease: per lease None (renewed, or undecided) or why it is lost."""
        ...

    def hand_over(self, lease: Lease, ttl: float) -> str | None:
        """Turn ``lease`` into its own task's queued lock for ``ttl`` seconds, keeping its
        fencing token; the queued lock's nonce, or None when the lease was no longer held."""
        ...

    def forget(self, lease: Lease) -> None:
        """Stop renewing ``lease`` and never release it: its key lives out its ttl."""
        ...

    def release_nonce(self, key: str, nonce: str) -> bool:
        """Delete ``key`` if the acquisition with ``nonce`` holds it; True if deleted."""
        ...

    def release_by_task(self, key: str, task_id: str) -> bool:
        """Delete ``key`` if the task ``task_id`` holds it, whichever acquisition."""
        ...

    # -- operators ---------------------------------------------------------------------------

    def holder(self, key: str) -> Holder | None:
        """Who holds ``key`` as a quorum sees it; None when nobody does."""
        ...

    def inspect(self, key: str) -> LockInfo:
        """``key``'s holder, time left and fencing counter."""
        ...

    def locks(self, prefix: str = "") -> list[LockInfo]:
        """Every key starting with ``prefix`` that is held (or was: free keys may be listed)."""
        ...

    def force_release(self, key: str, holder: Holder) -> bool:
        """Release ``key`` from the acquisition ``holder``; its renewal reports it lost."""
        ...

    def purge(self, prefix: str) -> list[str]:
        """Force-release every key starting with ``prefix``; the keys released."""
        ...

    def line(self, key: str) -> list[Holder]:
        """The holder and every waiter of ``key`` that has a place in line, in the order they
        will hold it; empty where a waiter leaves nothing in the store (Redis, in-process): a
        killed waiter then needs no withdrawing."""
        ...

    def endpoints(self) -> list[str]:
        """Where the store is: one line per node, credentials hidden."""
        ...

    def describe(self) -> str:
        """Where the store is, in one line for operators (its kind and its endpoints)."""
        ...

    def check(self) -> list[tuple[str, str | None]]:
        """Contact every node: ``(endpoint, error)``, error None for a node that answered."""
        ...

    def close(self) -> None:
        """Close this backend's connections."""
        ...


class BaseBackend:
    """What the backends share above the seam: :meth:`purge` (every backend), and
    :meth:`acquire`'s argument checks before :meth:`acquire_checked`, which each implements.

    Two hooks let a backend whose leases are not renewed on a ttl (ZooKeeper: a lease lasts
    with the session) share those checks: :meth:`check_interval` (None: no renewal interval
    taken) and :attr:`keeps_free_fence` (False: no fence retention taken, nothing is kept)."""

    settings: Settings
    keeps_free_fence: bool

    def locks(self, prefix: str = "") -> list[LockInfo]:
        raise NotImplementedError

    def force_release(self, key: str, holder: Holder) -> bool:
        raise NotImplementedError

    def duplicate_of(
        self, key: str, refusal: LockContended, looks: dict[str, int], results: TaskResults
    ) -> Holder | Literal[Again.LOOK] | None:
        """See :meth:`Backend.duplicate_of`: the holder named by the refusal, merged into at
        once (an acquisition others can read is decided); none named, look again a few times."""
        if refusal.holder is not None or refusal.retry_after is not None:
            return refusal.holder
        return look_again(looks, "unnamed", f"no holder of {key!r} could be read")

    def purge(self, prefix: str) -> list[str]:
        """Force-release every held key starting with ``prefix``; the keys released."""
        return [
            info.key
            for info in self.locks(prefix)
            if info.holder is not None and self.force_release(info.key, info.holder)
        ]

    def acquire(
        self,
        key: str,
        *,
        ttl: float | None = None,
        wait: float | None = 0.0,
        holder: str | None = None,
        renew: bool = True,
        renew_interval: float | None = None,
        max_hold: float | None = None,
        on_lost: LostCallback | None = None,
        takeover: str | None = None,
        queued: bool = False,
        sender: Any = None,
        fence_retention: float | None = None,
    ) -> Lease:
        """Take ``key`` for ``ttl`` seconds, renewed in the background until released.

        ``wait=0`` raises :class:`LockContended` at once if the key is held; ``wait>0`` waits
        in line up to that many seconds, woken by the holder's release; ``wait=None`` without
        bound. Raises :class:`LockUnavailable` when too few nodes answer.

        ``takeover`` (a task id) also succeeds when the key holds that task's *queued* lock;
        ``queued=True`` writes such a lock (enqueue-time mode). ``sender`` is passed to the
        signals (the task, when a task holds the lock). ``fence_retention`` (seconds) overrides
        how long this key's fence counter is kept, for one-shot keys that need no history.
        """
        key = check_key(key)
        settings = self.settings
        ttl = settings.ttl if ttl is None else check_ttl("ttl", ttl, settings.drift_factor)
        interval = self.check_interval(renew_interval, ttl) if renew else None
        if wait is not None:
            wait = check_seconds("wait", wait, allow_zero=True)
        if max_hold is not None:
            max_hold = check_seconds("max_hold", max_hold)
        if not self.keeps_free_fence:
            fence_retention = None  # nothing is kept for a free key: no retention to set
        elif fence_retention is not None:
            fence_retention = check_seconds("fence_retention", fence_retention)
        if holder is not None and not isinstance(holder, str):
            raise ConfigError(f"holder must be a str (a task id) or None, not {holder!r}.")
        if takeover is not None and not isinstance(takeover, str):
            raise ConfigError(f"takeover must be a str (a task id) or None, not {takeover!r}.")
        return self.acquire_checked(
            key,
            ttl,
            wait,
            holder=holder,
            interval=interval,
            max_hold=max_hold,
            on_lost=on_lost,
            takeover=takeover,
            queued=queued,
            sender=sender,
            fence_retention=fence_retention,
        )

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
        """:meth:`acquire` for arguments already checked (a task checks its options once)."""
        raise NotImplementedError

    def check_interval(self, renew_interval: Any, ttl: float) -> float | None:
        """The renewal interval :meth:`acquire` passes on for ``renew_interval`` (checked
        against ``ttl``; default ttl / 3); a backend whose leases are not renewed on a ttl
        returns None, taking none."""
        return check_renew_interval(renew_interval, ttl, self.settings.drift_factor)


def look_again(looks: dict[str, int], reason: str, why: str) -> Literal[Again.LOOK]:
    """:data:`LOOK_AGAIN` after a short random delay, counted in ``looks[reason]``; raises
    :class:`LockUnavailable` (``why``) after :data:`UNNAMED_RETRIES` looks for ``reason``."""
    done = looks.get(reason, 0)
    if done >= UNNAMED_RETRIES:
        raise LockUnavailable(why)
    looks[reason] = done + 1
    time.sleep(jitter(0.0, 0.01 * (done + 1)))
    return LOOK_AGAIN
