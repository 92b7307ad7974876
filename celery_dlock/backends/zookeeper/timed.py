"""Timed nodes: the locks that must outlive the session that made them, and the one-transaction
replacements that make them.

* **Timed nodes** (persistent) hold a key for a ttl whatever becomes of the process that made
  them: a queued lock (``lock_on="enqueue"``: :meth:`ZooKeeperBackend.send_queued`, and
  ``acquire(queued=True)``), a retry's lock handed over (:func:`hand_over`), a forgotten
  lease such as a beat tick key (:func:`forget`). A timed node
  ends on the ZooKeeper leader's clock: its data holds ``ttl`` (and may hold ``from``), and it
  has expired once a *fresh stamp of the leader's clock* is at least ``from`` (default: its own
  ``ctime``) plus ``ttl``. ``ctime``/``mtime`` are the time the leader's request processor
  stamped on the write's transaction header when it prepared it (``PrepRequestProcessor``:
  ``new TxnHeader(..., zxid, Time.currentWallTime(), ...)``, and ``DataTree.createStat(zxid,
  hdr.getTime(), ...)``; followers forward writes to the leader, so every server stores the
  same stamp). A fresh stamp is the ``ctime`` of the contender's own node created in the same
  round trip as its listing, or the ``mtime`` of a write made for the purpose (an empty
  ``setData`` on the base node above every key). Nobody deletes a timed node early, because
  nobody reads a local clock to decide: a contender that finds an expired timed node deletes it
  (version-checked) and looks again; a waiter queued behind a timed node reads its remaining
  life (``from + ttl`` minus the fresh stamp), sleeps that long counted from when the stamp's
  reply *arrived* (so it wakes late, not early), then takes a new stamp and checks again. The
  process that forgot a session lease (a tick key) also deletes its timed node at expiry if
  it is still alive; an expired node nobody deleted is deleted by the key's next contender,
  or by an operator's ``celery dlock`` inspection of the key. A timed node whose acquisition
  was refused is deleted at once; should its process die in that round trip, the node waits
  in line until its ttl ends (on Redis, a publisher dying between taking a queued lock and
  publishing likewise leaves the key held for its ttl). Clock assumption (the same as a Redis
  key's ttl, which runs on the master's clock): the leader's wall clock runs at the rate of
  real time (a clock running fast ends timed nodes early by its rate error) and is not
  stepped; across a leader change between the two stamps
  (the zxid's epoch, its high 32 bits, changes) the old and new leaders' clocks must agree
  (NTP), else the expiry comes early or late by their difference. ZooKeeper's own TTL nodes
  were not used: they need ``extendedTypesEnabled`` on every server, and the server deletes
  them lazily (a check every minute by default), holding the key that long past its ttl.
* **Replacements keep the key's place in line.** A hand-over (the holder's node becomes its
  retry's queued lock), an adoption (a worker starting a queued task takes over its queued
  lock: :func:`adopt`) and a forget (a session node becomes timed) are each ONE multi-op
  transaction: create the replacement, ``setData`` the replaced node (its reply carries the
  transaction's zxid and time, which kazoo's reply to a create in a multi does not), delete
  it. The replacement's name carries ``~o<order>``, the replaced node's order, so it sorts
  exactly where the replaced node was; nobody can be admitted in between, because the
  replaced node is gone only when the replacement exists. The waiter right behind sees its
  watch fire as a change, lists the children again, finds the replacement ahead of it and
  watches that instead. The same transaction sets the key's parent's data (see
  :mod:`celery_dlock.backends.zookeeper.decisions`).
"""

from __future__ import annotations

import logging
import secrets
import time
from functools import partial
from typing import Any, NamedTuple

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss
from kazoo.protocol.states import ZnodeStat

from celery_dlock.backends.zookeeper.decisions import failed
from celery_dlock.backends.zookeeper.keyspace import Keyspace
from celery_dlock.backends.zookeeper.lease import NodeLease, ZkLease
from celery_dlock.backends.zookeeper.nodes import (
    NodeName,
    expires_ms,
    identity,
    order_of,
    task_name,
    timed_data,
)
from celery_dlock.backends.zookeeper.nodes import prefix as node_prefix
from celery_dlock.backends.zookeeper.reaper import reaper
from celery_dlock.backends.zookeeper.session import UNREACHABLE, SharedClient
from celery_dlock.backends.zookeeper.znodes import find, read, reap, stamp
from celery_dlock.core.holder import head_nonce
from celery_dlock.core.lease import Lease

log = logging.getLogger("celery_dlock.zookeeper")


def _replacement(
    client: KazooClient,
    session: SharedClient,
    parent: str,
    replaced: str,
    name: str,
    data: bytes,
    *,
    ephemeral: bool,
    also_delete: str | None = None,
) -> Any:
    """The multi-op transaction that replaces the node ``replaced`` by a new sequential node
    ``name`` (a prefix carrying ``~o<order>``) under ``parent``; not sent yet."""
    transaction = client.transaction()
    transaction.create(
        f"{parent}/{name}", data, acl=session.acl, ephemeral=ephemeral, sequence=True
    )
    # A waiter watching the replaced node sees a change, not a deletion: it lists again.
    transaction.set_data(replaced, b"")
    transaction.delete(replaced)
    if also_delete is not None:
        transaction.delete(also_delete)
    transaction.set_data(parent, b"")  # the key has had a replacement (fencing module)
    return transaction


class Adopted(NamedTuple):
    """A queued lock taken over: our session node in its place."""

    path: str  # its sequence number gives the token (see the fencing module)
    ctime_ms: int
    asked: float  # when the transaction was sent


def adopt(
    client: KazooClient,
    session: SharedClient,
    parent: str,
    nonce: str,
    data: bytes,
    head: NodeName,
    path: str,
) -> Adopted | None:
    """Take over the queued lock ``head`` of our own task: one transaction creates our
    session node in its place (its order) and deletes it and our first node ``path``. None
    when it did not apply (the queued lock is gone: the caller lists again). Raises the kazoo
    error when it failed otherwise."""
    head_path = f"{parent}/{head.name}"
    transaction = _replacement(
        client,
        session,
        parent,
        head_path,
        node_prefix(nonce, order=head.order),
        data,
        ephemeral=True,
        also_delete=path,
    )
    asked = time.monotonic()
    try:
        results = transaction.commit_async().get(timeout=session.op_timeout)
    except ConnectionLoss:
        # The reply was lost: find out whether it happened.
        found = find(client, session, parent, nonce, replacement=True)
        if found is None:
            return None  # not applied: our first node is still in line
        new_path, stat = found
        return Adopted(new_path, int(stat.ctime), asked)
    if failed(results) is not None:
        return None
    new_path, stat = results[0], results[1]
    # Every operation of a multi has the transaction's time: the setData's stat carries it.
    return Adopted(new_path, int(stat.mtime), asked)


def replace(
    space: Keyspace,
    lease: ZkLease,
    nonce: str,
    data: bytes,
    *,
    queued_for: str | None,
) -> tuple[str, ZnodeStat] | None:
    """Replace ``lease``'s node by a timed node in its place in line (one transaction, see
    the module docstring): the new node's path and the setData's stat (the transaction's
    zxid and time), or None when the lease's node was gone. Raises the kazoo error when no
    answer came and it cannot be told whether the transaction happened."""
    session = space.shared
    client = session.start()
    parent, name = lease.path.rsplit("/", 1)
    order = order_of(name)
    deadline = time.monotonic() + session.op_timeout

    def applied() -> tuple[str, ZnodeStat] | None:
        found = find(client, session, parent, nonce, replacement=True)
        return None if found is None or found[0] == lease.path else found

    while True:
        transaction = _replacement(
            client,
            session,
            parent,
            lease.path,
            node_prefix(nonce, timed=True, task=queued_for, order=order),
            data,
            ephemeral=False,
        )
        try:
            left = max(0.001, deadline - time.monotonic())
            results = transaction.commit_async().get(timeout=left)
        except ConnectionLoss:
            found = applied()
            if found is not None:
                return found
            # Not applied (the request went down with the connection): send it again
            # while the replaced node is there. At most one of the two can apply, since
            # each deletes that node; a node left as it is would be held by this
            # process's session for as long as the process runs.
            if session.call(partial(client.exists_async, lease.path)) is None:
                return applied()
            if time.monotonic() >= deadline:
                raise
            continue
        if failed(results) is not None:
            # The replaced node is gone: deleted, or replaced by an earlier copy of this
            # very transaction that did apply after all.
            return applied()
        return results[0], results[1]


def forget(space: Keyspace, lease: Lease) -> None:
    """Stop tracking ``lease`` without releasing it: its key lives out its ttl even if this
    process ends (a beat tick key). A session node is replaced by a timed node in its place
    in line, living ``ttl`` from the session node's creation (from the replacement's, if
    the acquisition waited in line: its ttl then counts from when it got the key, later);
    a timed node (a queued lock) is simply left to its ttl. This process also deletes a
    forgotten session lease's node at its expiry if it is still running (one thread,
    :data:`~celery_dlock.backends.zookeeper.reaper.reaper`); else the key's next contender does."""
    assert isinstance(lease, ZkLease)
    session = space.shared
    with lease.io_lock:
        if not session.let_go(lease):
            return
        timed = isinstance(lease, NodeLease) and lease.timed
        path: str | None = lease.path
        if not timed and isinstance(lease, NodeLease):
            anchor = None if lease.waited else lease.ctime_ms
            data = timed_data(lease.head, lease.ttl, anchor)
            try:
                replaced = replace(space, lease, head_nonce(lease.head), data, queued_for=None)
                path = None if replaced is None else replaced[0]
            except UNREACHABLE as exc:
                # Left a session node: it goes with the session, or at its ttl (below).
                log.warning(
                    "key=%s token=%s: could not make the forgotten lease outlive this "
                    "process (%s); it ends with the session",
                    lease.key,
                    lease.token,
                    exc,
                )
    if path is None or timed:
        return  # a queued lock: adopted, or deleted by the key's next contender
    reaper.add(lease.acquired_at + lease.ttl, partial(reap_at_expiry, space, path, lease.ttl))


def reap_at_expiry(space: Keyspace, path: str, ttl: float) -> float | None:
    """Delete a forgotten node once expired on the leader's clock (a session node left by
    a failed replacement: at once). Returns in how many seconds to look again (not yet
    expired, or no server answered), or None when done."""
    session = space.shared
    try:
        client = session.start()
        found = read(client, session, path)
        if found is None:
            return None
        raw, stat = found
        if stat.ephemeralOwner:
            reap(client, session, path, stat.version)
            return None
        now_ms, _ = stamp(client, session, space.base)
        left_ms = expires_ms(raw, stat, ttl) - now_ms
        if left_ms <= 0:
            reap(client, session, path, stat.version)
            return None
        return left_ms / 1000.0
    except UNREACHABLE:
        return session.negotiated / 3


def hand_over(space: Keyspace, lease: Lease, ttl: float) -> str | None:
    """Turn ``lease`` into the queued lock of its own task's next message (a retry): its
    node is replaced, in one transaction, by a timed node in its place in line, adoptable
    by that task id, living ``ttl``. Returns the queued lock's nonce (for the message to
    carry), or None when the lease was no longer held. The queued lock's fencing token
    (from its sequence number) is larger than the lease's: see
    :mod:`celery_dlock.backends.zookeeper.decisions`."""
    assert isinstance(lease, ZkLease)
    session = space.shared
    nonce = secrets.token_urlsafe(15)
    with lease.io_lock:
        lease.notice_expiry()
        if not session.let_go(lease) or lease.holder is None:
            return None
        data = identity(
            nonce, lease.holder, queued=True, task=task_name(lease.sender), ttl=ttl
        ).encode()
        try:
            replaced = replace(space, lease, nonce, data, queued_for=lease.holder)
        except UNREACHABLE as exc:
            log.warning(
                "key=%s token=%s: hand-over to the retry of %s not confirmed (%s); the "
                "key is freed instead",
                lease.key,
                lease.token,
                lease.holder,
                exc,
            )
            # The retry goes out without the key: free it (the session node, or nothing
            # if the hand-over applied after all) rather than hold it while we run.
            reaper.add(time.monotonic(), partial(reap_at_expiry, space, lease.path, ttl))
            return None
    if replaced is None:
        return None
    log.debug("handed key=%s over to the queued retry of %s", lease.key, lease.holder)
    return nonce
