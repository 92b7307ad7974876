"""A held lease's node while it is held and when it ends: the watchdog's confirmation of the
session (:func:`renew`) and the release (:func:`release`). A lease kept past this process is
:mod:`celery_dlock.zookeeper.timed`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kazoo.exceptions import NoNodeError

from celery_dlock.errors import LockUnavailable
from celery_dlock.lease import Lease
from celery_dlock.zookeeper.keyspace import Keyspace
from celery_dlock.zookeeper.lease import ZkLease
from celery_dlock.zookeeper.session import KAZOO_ERRORS, UNREACHABLE
from celery_dlock.zookeeper.znodes import owe_if_failed

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


def renew(space: Keyspace, leases: Sequence[Lease]) -> list[str | None]:
    """Confirm each lease's node with one ``exists`` (all sent together): the answer moves
    its validity on (see :class:`ZkLease`); no answer is undecided (None), the watchdog
    tries again until the validity runs out; a missing node is a loss."""
    session = space.shared
    started = time.monotonic()
    try:
        client = session.start()
    except LockUnavailable:
        return [None] * len(leases)
    sent = [client.exists_async(lease.path) for lease in leases if isinstance(lease, ZkLease)]
    timeout = max(0.001, min(lease.valid_for for lease in leases))
    out: list[str | None] = []
    for lease, result in zip(leases, sent, strict=True):
        try:
            stat = result.get(timeout=max(0.001, started + timeout - time.monotonic()))
        except KAZOO_ERRORS:
            out.append(None)
            continue
        if stat is None:
            out.append("its lock node is gone (deleted by another client, or its session expired)")
        else:
            lease.renewed(started, started + space.validity(session))
            out.append(None)
    return out
