"""A held lease's node while it is held and when it ends: the watchdog's confirmation of the
session (:func:`renew`) and the release (:func:`release`). A lease kept past this process is
:mod:`celery_dlock.backends.zookeeper.timed`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kazoo.exceptions import NoNodeError

from celery_dlock.backends.zookeeper.keyspace import Keyspace
from celery_dlock.backends.zookeeper.lease import ZkLease
from celery_dlock.backends.zookeeper.session import KAZOO_ERRORS, UNREACHABLE, SharedClient
from celery_dlock.backends.zookeeper.znodes import owe_if_failed
from celery_dlock.core.errors import LockUnavailable
from celery_dlock.core.lease import Lease

log = logging.getLogger("celery_dlock.zookeeper")


def release(space: Keyspace, lease: Lease, *, wait: bool = True) -> bool:
    """Delete the lease's node; True if the delete was confirmed. Idempotent, never
    raises for an unreachable ensemble: an unconfirmed delete is sent again when the
    connection is back (and the node goes with the session anyway)."""
    assert isinstance(lease, ZkLease)
    session = space.shared
    with lease.io_lock:
        lease.notice_expiry()
        if not session.let_go(lease):
            return False
        confirmed: bool | None = None
        try:
            result = session.start().delete_async(lease.path)
            if wait:
                session.answer(result)  # not awaited while the connection is down
                confirmed = True
            else:
                result.rawlink(owe_if_failed(session, lease.path))
        except NoNodeError:
            confirmed = False
        except UNREACHABLE as exc:
            confirmed = False
            session.owe(lease.path)
            log.warning(
                "release of key=%s token=%s not confirmed (%s); retried when the "
                "connection is back",
                lease.key,
                lease.token,
                exc,
            )
    lease.announce_released(confirmed)
    return bool(confirmed)


_warned: set[tuple[str, float, float]] = set()


def _check_ttl(space: Keyspace, session: SharedClient, ttl: float) -> None:
    """Warn (once per URL, ttl and session timeout) when a session node cannot keep ``ttl``'s
    promise: a holder that dies frees its key when its session expires, a session timeout
    later, so a ttl shorter than the session timeout cannot bound that wait. Asked at a
    lease's renewal, so that a lease held only for a moment (a beat's tick key, forgotten at
    once) says nothing."""
    timeout = session.negotiated
    if ttl >= timeout:
        return
    seen = (space.url.shown, ttl, timeout)
    if seen in _warned:
        return
    _warned.add(seen)
    log.warning(
        "lock_ttl=%g s is shorter than the ZooKeeper session timeout (%g s) of %s: a holder "
        "that dies frees its key only when its session expires, up to %g s later (its own "
        "lease stays valid for %g s at most, as asked). To free keys within the ttl, ask "
        "for a session timeout no longer than it in the URL (?timeout=%g; the servers' "
        "minSessionTimeout, 2 x tickTime, must allow it), or use a ttl of at least %g s.",
        ttl,
        timeout,
        space.url.shown,
        timeout,
        ttl,
        ttl,
        timeout,
    )


def renew(space: Keyspace, leases: Sequence[Lease]) -> list[str | None]:
    """Confirm the session, and with it every lease on it: one request, whatever the number
    of leases (an ``exists`` on the base node; any answered request will do).

    The answer proves the servers heard from the session when it was sent, so every one of
    its ephemeral nodes was there then: each session lease's validity moves on (see
    :class:`ZkLease`), the due ones and the others alike, so that the watchdog finds them all
    due together next time and a process holding N leases sends one request per third of the
    session timeout (or of the shortest ttl), not N. A node deleted by another client is
    reported by its holder's watch (:mod:`celery_dlock.backends.zookeeper.loss`), an expired session
    by the session listener. No answer is undecided (None): the watchdog tries again until
    the validity runs out."""
    session = space.shared
    started = time.monotonic()
    undecided: list[str | None] = [None] * len(leases)
    try:
        client = session.start()
    except LockUnavailable:
        return undecided
    proof = client.exists_async(space.base)
    timeout = max(0.001, min(lease.valid_for for lease in leases))
    try:
        proof.get(timeout=timeout)
    except KAZOO_ERRORS:
        return undecided
    for lease in leases:
        _check_ttl(space, session, lease.ttl)
    with session.lock:
        held = set(session.leases)
    for lease in held.union(lease for lease in leases if isinstance(lease, ZkLease)):
        if not lease.released and not lease.lost:
            lease.renewed(started, started + space.lease_validity(session, lease.ttl))
    return undecided
