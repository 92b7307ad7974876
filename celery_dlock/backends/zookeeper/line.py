"""The lock recipe: a key's contenders wait in line as sequential nodes; the first holds it.

The recipe (https://zookeeper.apache.org/doc/current/recipes.html#sc_recipes_Locks): each
contender creates a *sequential* node under the key's parent node; the first node in line
holds the lock; a waiter watches only the node just before its own (no herd effect: a release
wakes one waiter), so waiters are admitted in arrival (FIFO) order. ::

    <chroot>/<prefix>/<quoted key>/<nonce>-0000000042      a session node
    <chroot>/<prefix>/<quoted key>/<nonce>~t~q<task>-0000000043   a timed (queued) node

Names and data are described in :mod:`celery_dlock.backends.zookeeper.nodes`; line order is a node's
*order*, its own sequence number unless it inherited one (a replacement, see
:mod:`celery_dlock.backends.zookeeper.timed`). Joining the line (create and list) is
:mod:`celery_dlock.backends.zookeeper.entry`; the next step given a listing is
:func:`celery_dlock.backends.zookeeper.decisions.admission`, which also holds the fencing
token's rules.

* **Cost.** The create and the listing of the parent are sent back to back on the session's
  connection, which ZooKeeper answers in order, so the listing already shows our node: taking a
  free key is one create and one list in one round trip; a refusal (``wait=0``) adds the read
  of the holder's identity and the delete of our node, again in one round trip; a release
  admits the next waiter with no request of its own, or (in a key that had a replacement)
  one listing (see :mod:`celery_dlock.backends.zookeeper.decisions`).
* **Session nodes** (ephemeral) are what :meth:`ZooKeeperBackend.acquire` takes: the lease
  lasts as long as the session, and its validity follows the session (:class:`ZkLease`).
  **Timed nodes** (persistent), for queued locks, hand-overs and forgotten leases, hold a key
  for a ttl whatever becomes of their process: see :mod:`celery_dlock.backends.zookeeper.timed`.
* **Adoption.** A worker's acquisition for task ``T`` (``takeover=T``) that finds the first
  node in line to be ``T``'s queued lock (its name carries ``~q`` and the hash of ``T``, so a
  plain listing shows it) replaces that node and its own new node with one session node in
  the queued lock's place. A non-matching acquisition waits behind it or is refused, naming
  the queued task, whose duplicates are thus merged into it. A queued lock is adopted even if
  its ttl ran out unnoticed (nobody deleted it yet): the task it was queued for is running.
* **Identity.** The node's data is one line of JSON (the random nonce, task id, task name,
  host, pid, start time, queued flag; a timed node's ttl) that ``celery dlock`` reads; the
  nonce also prefixes the node's name, so a create whose reply was lost is found again (the
  recipe's "recoverable errors" advice) and an operator's release names one acquisition.
* **Loss.** The holder watches its own node (:mod:`celery_dlock.backends.zookeeper.loss`): a delete
by
  anyone else (``celery dlock release``) reports the lease lost. Validity follows the session
  (:class:`ZkLease`); session states map onto it as described in
  :mod:`celery_dlock.backends.zookeeper.session`. A lease on a timed node is valid for its ttl
  (minus the drift allowance, counted from before its create was sent), whatever the session does.
* **Parents.** A key's parent node is a *container* node (ZooKeeper 3.5.3+): the servers
  delete it once its last child is gone (checked every ``znode.container.checkIntervalMs``,
  a minute by default), so keys used once do not accumulate parents. A contender whose create
  finds the parent gone creates it again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import EventType, WatchedEvent

from celery_dlock.backends.zookeeper import decisions
from celery_dlock.backends.zookeeper.entry import Attempt, Entered
from celery_dlock.backends.zookeeper.keyspace import Keyspace
from celery_dlock.backends.zookeeper.loss import Guard
from celery_dlock.backends.zookeeper.nodes import (
    NodeName,
    expires_ms,
    in_line,
    read_holder,
    seq_of,
    task_hash,
)
from celery_dlock.backends.zookeeper.session import KAZOO_ERRORS, SharedClient
from celery_dlock.backends.zookeeper.timed import adopt
from celery_dlock.backends.zookeeper.znodes import abandon, read, reap, stamp
from celery_dlock.core.clock import real_clock
from celery_dlock.core.errors import LockContended, LockUnavailable
from celery_dlock.core.holder import Holder

log = logging.getLogger("celery_dlock.zookeeper")


class Won(NamedTuple):
    """Where an acquisition ended up first in line."""

    path: str
    token: int  # its fencing token (see the decisions module)
    ctime_ms: int
    proven: float  # when the request that proved it (and the session) was sent
    waited: bool
    guard: Guard


class HeadVanished(Exception):
    """A refusal (``wait`` ran out) found the first node in line gone when it read its holder:
    released or replaced meanwhile. Our node is deleted; a fresh attempt may take the key, or
    name who holds it now."""

    def __init__(self, refusal: LockContended) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal


def queue(
    space: Keyspace,
    attempt: Attempt,
    entered: Entered,
    wait: float | None,
    takeover: str | None,
) -> Won:
    """Wait until our node is first in line (or adopt ``takeover``'s queued lock there).
    Returns where we won, and when the last request that showed it was sent (the session
    surely lives until then + its timeout: see :class:`ZkLease`). Raises LockContended
    when ``wait`` runs out (our node is then deleted)."""
    client, session, parent, key = (
        attempt.client,
        attempt.session,
        attempt.parent,
        attempt.key,
    )
    deadline = None if wait is None else attempt.begun + wait
    # The same length of real time bounds the wait too: a test's frozen time.monotonic()
    # (freezegun) would otherwise never let it end.
    real_end = None if wait is None else real_clock() + wait
    path = entered.path
    name = path.rsplit("/", 1)[1]
    children = entered.children
    count = entered.changes  # of the last listing
    replaced = entered.replaced  # ... and whether it showed a replacement ever happened
    seq = seq_of(name)
    birth = entered.birth
    proven = attempt.begun  # the create's send time
    # The freshest stamp of the leader's clock, and when its reply arrived here.
    now_ms, now_at = int(entered.stat.ctime), entered.received
    mine = task_hash(takeover) if takeover else None
    waited = False
    for _ in range(1_000_000):
        out_of_time = deadline is not None and (
            time.monotonic() >= deadline or (real_end is not None and real_clock() >= real_end)
        )
        step = decisions.admission(in_line(children), name, mine, out_of_time)
        if step.kind == decisions.GONE:
            raise LockUnavailable(
                f"cannot lock {key!r}: our queue node {name} vanished (session expired, "
                "or deleted by an operator)",
                key=key,
            )
        if step.kind == decisions.WON:
            token = decisions.token(birth=birth, replaced=replaced, count=count, seq=seq)
            return Won(path, token, int(entered.stat.ctime), proven, waited, attempt.guard)
        head = step.node
        assert head is not None
        if step.kind == decisions.ADOPT:
            won = _adopt(space, attempt, head, path, waited, birth)
            if won is not None:
                return won
        elif step.kind == decisions.REFUSE:
            if not head.timed:
                attempt.guard.cancel()
                raise contended(client, session, key, parent, head.name, name, birth)
            refusal = refuse_timed(space, attempt, head, path, now_ms, birth)
            if refusal is not None:
                raise refusal
        else:
            waited = True
            shortcut = decisions.may_skip_listing(step.position, replaced)
            now_ms, now_at, proven, done = wait_behind(
                space, attempt, head, shortcut, deadline, now_ms, now_at, proven
            )
            if done:
                token = decisions.token(birth=birth, replaced=False, count=count, seq=seq)
                return Won(path, token, int(entered.stat.ctime), proven, True, attempt.guard)
        try:
            asked = time.monotonic()
            children, listed = session.call(
                lambda: client.get_children_async(parent, include_data=True)
            )
            count, replaced = decisions.marks(listed, seq)
            proven = asked
        except KAZOO_ERRORS as exc:
            raise space.unavailable(key, "wait for", exc) from exc
    raise LockUnavailable(f"cannot lock {key!r}: its line never settled", key=key)


def refuse_timed(
    space: Keyspace, attempt: Attempt, head: NodeName, path: str, now_ms: int, birth: int
) -> LockContended | None:
    """``wait`` ran out behind a timed node: delete it if expired (None: look again), else
    the refusal naming its holder (our node deleted)."""
    client, session = attempt.client, attempt.session
    head_path = f"{attempt.parent}/{head.name}"
    try:
        found = read(client, session, head_path)
    except KAZOO_ERRORS as exc:
        raise space.unavailable(attempt.key, "lock", exc) from exc
    if found is None:
        return None
    raw, stat = found
    if expires_ms(raw, stat, space.ttl) <= now_ms:
        reap(client, session, head_path, stat.version)
        return None
    attempt.guard.cancel()
    abandon(client, session, path)
    holder = read_holder(raw, stat, birth + head.seq)
    who = holder.describe() if holder else "another contender"
    return LockContended(f"lock {attempt.key!r} is held by {who}", key=attempt.key, holder=holder)


def wait_behind(
    space: Keyspace,
    attempt: Attempt,
    predecessor: NodeName,
    shortcut: bool,
    deadline: float | None,
    now_ms: int,
    now_at: float,
    proven: float,
) -> tuple[int, float, float, bool]:
    """Watch the node just ahead of ours until it changes or goes, ``deadline``, or (a
    timed node) its expiry. Returns the freshest stamp of the leader's clock, when its
    reply arrived, the proof time, and True when we are certainly first in line now
    (only with ``shortcut``:
    :func:`~celery_dlock.backends.zookeeper.decisions.admitted_by_deletion`);
    else the caller lists again."""
    client, session, guard = attempt.client, attempt.session, attempt.guard
    woken = threading.Event()
    events: list[WatchedEvent] = []
    pred_path = f"{attempt.parent}/{predecessor.name}"

    def wake(event: WatchedEvent) -> None:
        events.append(event)
        woken.set()

    try:
        with session.lock:
            session.waiters.add(woken)
        guard.stop_children_watch(attempt.parent)
        guard.watch_own(now=True)  # sent with the next request: ready once admitted
        asked = time.monotonic()
        wake_at: float | None = None
        watching = False
        if predecessor.timed:
            found = read(client, session, pred_path, watch=wake)
            if found is not None:
                raw, stat = found
                left_ms = expires_ms(raw, stat, space.ttl) - now_ms
                if left_ms <= 0:
                    reap(client, session, pred_path, stat.version)
                    return now_ms, now_at, asked, False
                watching = True
                # Counted from when the stamp's reply arrived: the expiry comes no
                # earlier on this clock, so we wake late rather than early.
                wake_at = now_at + left_ms / 1000.0
        else:
            # A data watch (``get``): ``exists`` on a predecessor already gone would leave
            # a watch that never fires (see Guard.watch_own), one per such race.
            watching = read(client, session, pred_path, watch=wake) is not None
        proven = asked
        if watching:
            limits = [t for t in (deadline, wake_at) if t is not None]
            woken.wait(None if not limits else max(0.0, min(limits) - time.monotonic()))
        if wake_at is not None and not woken.is_set() and time.monotonic() >= wake_at:
            now_ms, now_at = stamp(client, session, space.base)
            return now_ms, now_at, proven, False
        deleted = any(e.type == EventType.DELETED for e in events)
        # The proof must leave the lease most of its validity, which the ttl caps too: a
        # proof older than the ttl would give a lease born expired.
        fresh = time.monotonic() - proven < min(session.negotiated, attempt.ttl) / 3
        done = decisions.admitted_by_deletion(shortcut, deleted, fresh, guard.deleted)
        return now_ms, now_at, proven, done
    except KAZOO_ERRORS as exc:
        raise space.unavailable(attempt.key, "wait for", exc) from exc
    finally:
        with session.lock:
            session.waiters.discard(woken)


def _adopt(
    space: Keyspace, attempt: Attempt, head: NodeName, path: str, waited: bool, birth: int
) -> Won | None:
    """Take over the queued lock ``head`` of our own task (:func:`~celery_dlock.backends.zookeeper.
    timed.adopt`); None when it did not apply (the caller lists again)."""
    try:
        adopted = adopt(
            attempt.client, attempt.session, attempt.parent, attempt.nonce, attempt.data, head, path
        )
    except KAZOO_ERRORS as exc:
        raise space.unavailable(attempt.key, "adopt the queued lock of", exc) from exc
    if adopted is None:
        return None
    attempt.guard.cancel()  # its node went with the transaction: no loss to report
    guard = Guard(attempt.client, attempt.session)
    guard.path = adopted.path
    guard.watch_own(now=True)
    log.debug("key=%s: adopted the queued lock of %s", attempt.key, attempt.holder)
    token = decisions.adopted(birth, seq_of(adopted.path))
    return Won(adopted.path, token, adopted.ctime_ms, adopted.asked, waited, guard)


def contended(
    client: KazooClient,
    session: SharedClient,
    key: str,
    parent: str,
    lowest: str,
    name: str,
    birth: int,
) -> LockContended:
    """The refusal, with the holder read while our node is deleted (one round trip)."""
    path = f"{parent}/{lowest}"
    sent = [client.get_async(path)]
    deleting = client.delete_async(f"{parent}/{name}")
    holder: Holder | None = None
    vanished = False
    try:
        raw, stat = session.call(lambda: sent.pop() if sent else client.get_async(path))
        holder = read_holder(raw, stat, birth + seq_of(lowest))
    except NoNodeError:
        # Released, or replaced (a beat's tick key made timed right after it was taken):
        # the caller tries again rather than refuse without naming a holder.
        vanished = True
    except KAZOO_ERRORS:
        holder = None  # unreadable: the refusal stands
    try:
        session.answer(deleting)
    except NoNodeError:
        pass
    except KAZOO_ERRORS:
        session.owe(f"{parent}/{name}")
    who = holder.describe() if holder else "another contender"
    refusal = LockContended(f"lock {key!r} is held by {who}", key=key, holder=holder)
    if vanished:
        raise HeadVanished(refusal)
    return refusal
