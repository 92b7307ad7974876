"""Leases on a ZooKeeper ensemble: :class:`ZooKeeperBackend`, the ``Backend``
(:mod:`celery_dlock.core.backend`) of a ``zookeeper://`` URL. It checks arguments and hands each
call to the module of ``celery_dlock.backends.zookeeper`` that does the work. The modules by layer,
from the bottom up (an import-linter contract in pyproject.toml keeps them so):

* ``url`` the URL and TLS; ``nodes`` lock node names and data;
* ``decisions`` a contender's next step and what the fencing token is (pure, no I/O);
  ``lease`` a lease's validity;
* ``session`` one kazoo client per process;
* ``keyspace`` where a backend's nodes live; ``znodes`` the small requests every part sends;
  ``loss`` a holder's watch on its own node; ``reaper`` the clean-up thread;
* ``timed`` timed nodes (queued locks, hand-over, forget, adoption) and their one-transaction
  replacements; ``entry`` joining a key's line (create and list in one round trip);
* ``line`` the lock recipe: waiting in line, admission, refusals;
* ``acquire`` from replies to a lease; ``holding`` renewal and release; ``inspection`` the
  operator's reads and repairs;
* ``lock`` this facade.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_dlock.backends.zookeeper import holding, inspection, timed
from celery_dlock.backends.zookeeper.acquire import Pending, finish
from celery_dlock.backends.zookeeper.entry import Attempt
from celery_dlock.backends.zookeeper.keyspace import Keyspace
from celery_dlock.backends.zookeeper.lease import NodeLease, ZkLease
from celery_dlock.backends.zookeeper.nodes import SEQ_DIGITS, identity, read_holder
from celery_dlock.backends.zookeeper.session import SharedClient
from celery_dlock.backends.zookeeper.url import ZkUrl
from celery_dlock.core.backend import BaseBackend
from celery_dlock.core.config import (
    DEFAULT_DRIFT_FACTOR,
    DEFAULT_PREFIX,
    DEFAULT_TTL,
    Settings,
)
from celery_dlock.core.errors import LockUnavailable
from celery_dlock.core.holder import Holder, LockInfo
from celery_dlock.core.lease import Lease, LostCallback

__all__ = ["SEQ_DIGITS", "NodeLease", "ZooKeeperBackend", "identity", "read_holder"]


class ZooKeeperBackend(BaseBackend):
    """Acquire and release leases on one ZooKeeper ensemble (a ``zookeeper://`` URL)."""

    #: An acquisition others can read is decided: never undone (see Backend.settle_time).
    settle_time = 0.0
    #: A lock lasts as long as its holder's session, with no ttl (see Backend.expires).
    expires = False
    #: A holder watches its own node: a forced release reaches it at once.
    release_seen_at_once = True
    #: A free key's parent node goes, and its tokens with it (see Backend.keeps_free_fence).
    keeps_free_fence = False

    def __init__(
        self,
        url: str | Settings,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl: float = DEFAULT_TTL,
        drift_factor: float = DEFAULT_DRIFT_FACTOR,
    ) -> None:
        """From one ``zookeeper://`` URL and the other settings, or from checked
        :class:`Settings` whose one URL is a ``zookeeper://`` URL (:func:`make_backend`)."""
        if not isinstance(url, Settings):
            url = Settings(urls=(url,), ttl=ttl, prefix=prefix, drift_factor=drift_factor)
        self.settings = url
        self.space = Keyspace(url)
        self.url: ZkUrl = self.space.url
        self.prefix = self.space.prefix
        self.ttl = self.space.ttl
        self.drift_factor = self.space.drift_factor
        self.base = self.space.base

    def __repr__(self) -> str:
        return f"<ZooKeeperBackend {self.url.shown} prefix={self.prefix!r}>"

    @property
    def shared(self) -> SharedClient:
        """This process's client for the ensemble (a new one after fork)."""
        return self.space.shared

    def parent(self, key: str) -> str:
        """The key's parent node, under which its contenders queue."""
        return self.space.parent(key)

    # -- acquire ---------------------------------------------------------------------------

    def check_interval(self, renew_interval: Any, ttl: float) -> None:
        """None, whatever ``renew_interval`` says: a lease here is a session node, with no ttl
        to renew; its validity is confirmed every third of the session timeout
        (:class:`ZkLease`), so ``renew``/``renew_interval`` are accepted for the common
        signature and unused (see :meth:`BaseBackend.acquire`)."""
        return

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
    ) -> ZkLease:
        """:meth:`acquire` for arguments already checked: ``wait=0`` raises
        :class:`LockContended` at once when ``key`` is held, ``wait=s`` queues up to ``s``
        seconds (FIFO), ``wait=None`` without bound.

        A lease on a session node: no ttl bounds it, its node lasts while the session does;
        ``ttl`` only times :meth:`forget`. ``queued=True`` takes a *timed* node instead, held
        for ``ttl`` whatever becomes of this process (a queued lock, enqueue-time mode).
        ``takeover`` (a task id) adopts that task's queued lock when it is first in line
        (see :mod:`celery_dlock.backends.zookeeper.line`). ``fence_retention`` is moot: the
        token is the key's parent node's creation time in µs plus its count of changes (see
        :mod:`celery_dlock.backends.zookeeper.decisions`)."""
        attempt = Attempt(self.space, key, ttl, holder, timed=queued, queued=queued, sender=sender)
        takeover = None if queued else takeover
        return finish(self, self.space, attempt, wait, takeover, max_hold, on_lost)

    def send_queued(
        self, key: str, ttl: float, *, holder: str, sender: Any = None
    ) -> Pending | None:
        """Send a queued lock's acquisition (a timed node's create and the listing) without
        waiting for the replies; :meth:`Pending.finish` reads them. None when no server
        answers (the caller's :meth:`acquire` then reports it)."""
        try:
            attempt = Attempt(self.space, key, ttl, holder, timed=True, queued=True, sender=sender)
        except LockUnavailable:
            return None
        return Pending(self, self.space, attempt)

    # -- hold and end a lease ----------------------------------------------------------------

    def release(self, lease: Lease, *, wait: bool = True) -> bool:
        """Delete the lease's node (:func:`celery_dlock.backends.zookeeper.holding.release`)."""
        return holding.release(self.space, lease, wait=wait)

    def renew(self, leases: Sequence[Lease]) -> list[str | None]:
        """Confirm each lease's node (:func:`celery_dlock.backends.zookeeper.holding.renew`)."""
        return holding.renew(self.space, leases)

    def forget(self, lease: Lease) -> None:
        """Stop tracking ``lease``; its key lives out its ttl
        (:func:`celery_dlock.backends.zookeeper.timed.forget`)."""
        timed.forget(self.space, lease)

    def hand_over(self, lease: Lease, ttl: float) -> str | None:
        """Turn ``lease`` into its task's retry's queued lock; its nonce, or None
        (:func:`celery_dlock.backends.zookeeper.timed.hand_over`)."""
        return timed.hand_over(self.space, lease, ttl)

    # -- operators (celery_dlock.backends.zookeeper.inspection)
    # -------------------------------------

    def holder(self, key: str) -> Holder | None:
        """The current holder (the first node's identity), or None when nobody holds ``key``."""
        return inspection.holder(self.space, key)

    def inspect(self, key: str) -> LockInfo:
        """The key's holder; the time left only for a timed node."""
        return inspection.inspect(self.space, key)

    def queue(self, key: str) -> list[Holder]:
        """The holder and every waiter of ``key``, in the order they will hold it."""
        return inspection.queue(self.space, key)

    def line(self, key: str) -> list[Holder]:
        """:meth:`queue`: every waiter has a node, a place in line (Backend.line)."""
        return inspection.queue(self.space, key)

    def locks(self, prefix: str = "") -> list[LockInfo]:
        """Every key starting with ``prefix`` that has a parent node (free keys included)."""
        return inspection.locks(self.space, prefix)

    def force_release(self, key: str, holder: Holder) -> bool:
        """Delete ``holder``'s node: the holder's lease is lost, the next waiter admitted."""
        return inspection.force_release(self.space, key, holder)

    def release_nonce(self, key: str, nonce: str) -> bool:
        """Delete the node of the acquisition with ``nonce`` on ``key`` (holder or waiter)."""
        return inspection.release_nonce(self.space, key, nonce)

    def release_by_task(self, key: str, task_id: str) -> bool:
        """Delete ``key``'s node if task ``task_id`` holds it, whichever acquisition."""
        return inspection.release_by_task(self.space, key, task_id)

    def endpoints(self) -> list[str]:
        """One line per server of the ensemble, credentials hidden, with the chroot."""
        return inspection.endpoints(self.url, self.base)

    def describe(self) -> str:
        """The ensemble and its servers."""
        urls = self.endpoints()
        servers = "server" if len(urls) == 1 else f"ensemble of {len(urls)} servers"
        return f"ZooKeeper {servers}: {', '.join(urls)}"

    def check(self) -> list[tuple[str, str | None]]:
        """Whether each server serves clients: ``(endpoint, error)``, None when it does."""
        return inspection.check(self.space)

    def close(self) -> None:
        """Nothing of its own to close: the process's client is shared (see
        :func:`celery_dlock.backends.zookeeper.session.close_all`)."""
