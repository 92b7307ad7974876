"""An acquisition from its sent requests to its lease: read the replies, wait in line
(:mod:`celery_dlock.backends.zookeeper.line`), then make the lease, track it and say so
(``lock_acquired``)."""

from __future__ import annotations

import logging
import time
from functools import partial

from celery_dlock.backends.zookeeper.entry import Attempt, enter
from celery_dlock.backends.zookeeper.keyspace import Keyspace
from celery_dlock.backends.zookeeper.lease import NodeLease
from celery_dlock.backends.zookeeper.line import HeadVanished, Won, queue
from celery_dlock.backends.zookeeper.session import KAZOO_ERRORS
from celery_dlock.backends.zookeeper.znodes import abandon
from celery_dlock.core.config import drift
from celery_dlock.core.errors import LockContended, LockUnavailable
from celery_dlock.core.lease import Lease, LeaseBackend, LostCallback
from celery_dlock.core.renewal import watchdog
from celery_dlock.core.signals import lock_acquired

log = logging.getLogger("celery_dlock.zookeeper")

#: Fresh attempts when a refusal found the first node gone before it could name its holder.
HEAD_VANISHED_RETRIES = 3


def finish(
    backend: LeaseBackend,
    space: Keyspace,
    attempt: Attempt,
    wait: float | None,
    takeover: str | None,
    max_hold: float | None,
    on_lost: LostCallback | None,
) -> NodeLease:
    """Read an attempt's replies, wait in line as ``wait`` allows, and make the lease (of
    ``backend``, which releases it)."""
    for tries in range(1, HEAD_VANISHED_RETRIES + 1):
        try:
            won = _first_in_line(space, attempt, wait, takeover)
            break
        except HeadVanished as vanished:
            if tries == HEAD_VANISHED_RETRIES:
                raise vanished.refusal from None
        # A fresh attempt only when it will be read: its node would wait in line, unread.
        attempt = attempt.again(space)
    return _lease(backend, space, attempt, _proven_afresh(space, attempt, won), max_hold, on_lost)


def _proven_afresh(space: Keyspace, attempt: Attempt, won: Won) -> Won:
    """``won``, or with a fresh proof of the session when the request that proved it was
    answered late (a leader election, a server's pause, a slow link): a session lease's
    validity runs from that request's send and is capped by its ttl, so it could be over
    before the lease is handed out. One ``exists`` (any answered request proves the session
    and so our node; a deletion is the guard's to report); when even that is answered too late
    for the ttl, the node is deleted and the caller told, as the Redis backends tell an
    acquisition that took longer than its validity. Timed nodes live their ttl from their
    creation, which no later request changes."""
    session = attempt.session
    if attempt.timed or time.monotonic() - won.proven < min(session.negotiated, attempt.ttl) / 3:
        return won
    asked = time.monotonic()
    try:
        session.call(partial(attempt.client.exists_async, space.base))
        late = time.monotonic() - asked >= space.lease_validity(session, attempt.ttl)
    except KAZOO_ERRORS as exc:
        attempt.guard.cancel()
        abandon(attempt.client, session, won.path)
        raise space.unavailable(attempt.key, "lock", exc) from exc
    if late:
        attempt.guard.cancel()
        abandon(attempt.client, session, won.path)
        raise LockUnavailable(
            f"cannot lock {attempt.key!r}: ZooKeeper ({space.url.shown}) answered more slowly "
            f"than the ttl of {attempt.ttl:g} s allows a lease to be proven; use a longer ttl",
            key=attempt.key,
        )
    return won._replace(proven=asked)


def _first_in_line(
    space: Keyspace, attempt: Attempt, wait: float | None, takeover: str | None
) -> Won:
    """One attempt's replies read and its wait in line (:class:`HeadVanished`: make another);
    our node is deleted when it does not win."""
    try:
        entered = enter(space, attempt)
    except BaseException as exc:
        # The create may yet be sent (kazoo keeps it while the connection is down), or was
        # made with its reply lost: its node is deleted whenever it turns up.
        attempt.guard.cancel()
        attempt.session.disown(attempt.created, attempt.parent, attempt.nonce)
        if isinstance(exc, KAZOO_ERRORS):
            raise space.unavailable(attempt.key, "lock", exc) from exc
        raise
    attempt.guard.path = entered.path
    try:
        return queue(space, attempt, entered, wait, takeover)
    except (LockContended, HeadVanished):
        raise  # our node is already deleted
    except BaseException:
        attempt.guard.cancel()
        abandon(attempt.client, attempt.session, entered.path)
        raise


def _lease(
    backend: LeaseBackend,
    space: Keyspace,
    attempt: Attempt,
    won: Won,
    max_hold: float | None,
    on_lost: LostCallback | None,
) -> NodeLease:
    """The lease of an attempt that won: tracked (a session node's), guarded, announced."""
    session, key = attempt.session, attempt.key
    timed = attempt.timed
    if timed:
        deadline = attempt.begun + attempt.ttl - drift(attempt.ttl, space.drift_factor)
    else:
        deadline = won.proven + space.lease_validity(session, attempt.ttl)
    lease = NodeLease(
        backend,
        won.path,
        ctime_ms=won.ctime_ms,
        waited=won.waited,
        timed=timed,
        key=key,
        token=won.token,
        head=attempt.data.decode(),
        holder=attempt.holder,
        ttl=attempt.ttl,
        started=attempt.begun if timed else won.proven,
        deadline=deadline,
        renew_interval=None if timed else renew_every(min(session.negotiated, attempt.ttl)),
        max_hold=max_hold,
        sender=attempt.sender,
    )
    if on_lost is not None:
        lease.on_lost(on_lost)
    if not timed:
        session.add(lease)
        watchdog.add(lease)  # confirms the session every third of its timeout (renew())
    won.guard.attach(lease)
    waited_for = time.monotonic() - attempt.begun
    log.debug("acquired key=%s token=%s waited=%.3f", key, lease.token, waited_for)
    lock_acquired.send(
        sender=attempt.sender,
        key=key,
        token=lease.token,
        task_id=attempt.holder,
        waited=waited_for,
    )
    return lease


#: kazoo pings a third of the session timeout after its last send, less a random 0.01-0.4 s.
KAZOO_PING_JITTER = 0.4


def renew_every(span: float) -> float:
    """How often the watchdog confirms a session lease valid for ``span`` seconds: a third of
    it, a little less than kazoo's ping interval, so that our request (which proves the
    session as a ping does, see :func:`celery_dlock.backends.zookeeper.holding.renew`) goes before
    kazoo's ping is due and kazoo sends none: holding leases then costs the session about
    what an idle kazoo client costs."""
    third = span / 3
    return third - min(KAZOO_PING_JITTER + 0.05, third / 4)


class Pending:
    """A queued lock's acquisition sent by :meth:`ZooKeeperBackend.send_queued`, not read yet."""

    def __init__(self, backend: LeaseBackend, space: Keyspace, attempt: Attempt) -> None:
        self.key = attempt.key
        self._backend = backend
        self._space = space
        self._attempt = attempt

    @property
    def nonce(self) -> str:
        """The random nonce of the acquisition sent (whether or not it took the key)."""
        return self._attempt.nonce

    def finish(self) -> Lease:
        """Read the replies: the lease, or raise LockContended / LockUnavailable."""
        return finish(self._backend, self._space, self._attempt, 0.0, None, None, None)
