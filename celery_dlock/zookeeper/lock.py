"""Leases on a ZooKeeper ensemble: the lock recipe with sequential nodes, and timed nodes for
the locks that must outlive the session that made them.

The recipe (https://zookeeper.apache.org/doc/current/recipes.html#sc_recipes_Locks): each
contender creates a *sequential* node under the key's parent node; the first node in line
holds the lock; a waiter watches only the node just before its own (no herd effect: a release
wakes one waiter), so waiters are admitted in arrival (FIFO) order. ::

    <chroot>/<prefix>/<quoted key>/<nonce>-0000000042      a session node
    <chroot>/<prefix>/<quoted key>/<nonce>~t~q<task>-0000000043   a timed (queued) node

Names and data are described in :mod:`celery_dlock.zookeeper.nodes`; line order is a node's
*order*, its own sequence number unless it inherited one (below).

* **Cost.** The create and the listing of the parent are sent back to back on the session's
  connection, which ZooKeeper answers in order, so the listing already shows our node: taking a
  free key is one create and one list in one round trip; a refusal (``wait=0``) adds the read
  of the holder's identity and the delete of our node, again in one round trip; a release
  admits the next waiter with no request of its own, or (in a key that had a replacement)
  one listing (see the fencing token).
* **Session nodes** (ephemeral) are what :meth:`ZooKeeperBackend.acquire` takes: the lease
  lasts as long as the session, and its validity follows the session (:class:`ZkLease`).
* **Timed nodes** (persistent) hold a key for a ttl whatever becomes of the process that made
  them: a queued lock (``lock_on="enqueue"``: :meth:`ZooKeeperBackend.send_queued`, and
  ``acquire(queued=True)``), a retry's lock handed over (:meth:`ZooKeeperBackend.hand_over`),
  a forgotten lease such as a beat tick key (:meth:`ZooKeeperBackend.forget`). A timed node
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
  lock) and a forget (a session node becomes timed) are each ONE multi-op transaction: create
  the replacement, ``setData`` the replaced node (its reply carries the transaction's zxid
  and time, which kazoo's reply to a create in a multi does not), delete it. The
  replacement's name carries ``~o<order>``, the replaced node's order, so it sorts exactly
  where the replaced node was; nobody can be admitted in between, because the replaced node
  is gone only when the replacement exists. The waiter right behind sees its watch fire as a
  change, lists the children again, finds the replacement ahead of it and watches that
  instead. The same transaction sets the key's parent's data (see the fencing token).
* **Adoption.** A worker's acquisition for task ``T`` (``takeover=T``) that finds the first
  node in line to be ``T``'s queued lock (its name carries ``~q`` and the hash of ``T``, so a
  plain listing shows it) replaces that node and its own new node with one session node in
  the queued lock's place. A non-matching acquisition waits behind it or is refused, naming
  the queued task, whose duplicates are thus merged into it. A queued lock is adopted even if
  its ttl ran out unnoticed (nobody deleted it yet): the task it was queued for is running.
* **Fencing token** = a zxid, the id ZooKeeper's leader gives each write (epoch in the high
  32 bits, a counter in the low 32); every server applies writes in zxid order, so zxids
  strictly increase across the whole ensemble, through leader changes (a new leader starts a
  higher epoch)
  (https://zookeeper.apache.org/doc/current/zookeeperInternals.html#sc_guaranteesPropertiesDefinitions).
  Which zxid depends on whether the key ever had a *replacement* (every replacement's
  transaction also sets the key's parent's data, so the parent's data version, which every
  listing returns, says so):

  - Never: the lock node's ``czxid``. Without replacements line order is creation order, so
    each holder's node is younger than every earlier holder's. A waiter that was second in
    its last listing is admitted by its predecessor's deletion alone, without listing again
    (the replaced node's ``setData`` makes a replacement fire as a change, not a deletion),
    which saves a round trip on every hand-over between waiters.
  - Since a replacement: the ``pzxid`` (zxid of the last change to the parent's children) of
    the listing that shows the node first; for an adoption, its transaction's zxid. The
    ``czxid`` would no longer do: a replacement is created later than the waiters queued
    behind the node it replaces, yet holds before them. The previous holder's token was
    read before its node was removed (so it is below the zxid of that removal, whichever
    rule gave it), and our listing shows that node gone (so its pzxid is at least that zxid).
    Such a waiter therefore lists again after its predecessor's deletion too (kazoo's
    ``Lock`` always does). A replacement only ever replaces the first node in line (a
    holder's or a queued lock), which is what makes the short cut above safe up to the
    first replacement: a replacement of the predecessor fires as a change.

  Strictly increasing per key either way. The key's parent forgets (its data version back
  to 0) only when the servers delete it empty, after every earlier holder is gone.
  ``Holder.fence`` (``holder()``, ``celery dlock``) shows the holder's node's ``czxid``: its
  lease's token or, since a replacement, at most that. A queued lock gets its token as any
  acquisition does (a hand-over's: the transaction's zxid), below the token of the
  execution that adopts it. A hand-over therefore does not keep the token as Redis does: the
  retry's queued lock, then its execution, each get a larger one, which keeps the promise.
  Tokens do not survive wiping the ensemble's data.
* **Identity.** The node's data is one line of JSON (the random nonce, task id, task name,
  host, pid, start time, queued flag; a timed node's ttl) that ``celery dlock`` reads; the
  nonce also prefixes the node's name, so a create whose reply was lost is found again (the
  recipe's "recoverable errors" advice) and an operator's release names one acquisition.
* **Loss.** The holder watches its own node: a delete by anyone else (``celery dlock
  release``) reports the lease lost. Validity follows the session (:class:`ZkLease`); session
  states map onto it as described in :mod:`celery_dlock.zookeeper.session`. A lease on a timed
  node is valid for its ttl (minus the drift allowance, counted from before its create was
  sent), whatever the session does.
* **Parents.** A key's parent node is a *container* node (ZooKeeper 3.5.3+): the servers
  delete it once its last child is gone (checked every ``znode.container.checkIntervalMs``,
  a minute by default), so keys used once do not accumulate parents. A contender whose create
  finds the parent gone creates it again.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple
from urllib.parse import quote, unquote

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, NoAuthError, NodeExistsError, NoNodeError
from kazoo.protocol.serialization import Create2
from kazoo.protocol.states import EventType, WatchedEvent, ZnodeStat
from kazoo.security import OPEN_ACL_UNSAFE

from celery_dlock import forks
from celery_dlock.config import (
    DEFAULT_DRIFT_FACTOR,
    DEFAULT_PREFIX,
    DEFAULT_TTL,
    Settings,
    check_key,
    check_seconds,
    check_ttl,
    drift,
)
from celery_dlock.errors import ConfigError, LockContended, LockUnavailable
from celery_dlock.holder import Holder, LockInfo, head_nonce
from celery_dlock.lease import Lease, LostCallback
from celery_dlock.renewal import watchdog
from celery_dlock.signals import lock_acquired, lock_released
from celery_dlock.zookeeper.lease import ZkLease
from celery_dlock.zookeeper.nodes import (
    SEQ_DIGITS,
    NodeName,
    expires_ms,
    identity,
    in_line,
    parse_name,
    read_holder,
    task_hash,
    timed_data,
)
from celery_dlock.zookeeper.nodes import prefix as node_prefix
from celery_dlock.zookeeper.session import KAZOO_ERRORS, UNREACHABLE, SharedClient, shared
from celery_dlock.zookeeper.url import ZkUrl, parse

__all__ = ["SEQ_DIGITS", "NodeLease", "ZooKeeperBackend", "identity", "read_holder"]

log = logging.getLogger("celery_dlock.zookeeper")

#: ZooKeeper's CreateMode.CONTAINER flag.
CONTAINER = 4


class _CreateContainer(Create2):  # type: ignore[misc]  # kazoo is untyped
    """ZooKeeper's ``createContainer`` request (opcode 19; kazoo has no call for it): the
    same fields and reply as ``create2``."""

    type = 19


def _node_name(key: str) -> str:
    """``key`` as one znode name: percent-quoted ('/' and all), never '.' or '..'."""
    name = quote(key, safe="")
    return name.replace(".", "%2E") if name in (".", "..") else name


def _task_name(sender: Any) -> str | None:
    name = getattr(sender, "name", None)
    return name if isinstance(name, str) else None


def _failed(results: Sequence[Any]) -> BaseException | None:
    """The error of a multi-op transaction's results (kazoo returns them, not raises)."""
    for result in results:
        if isinstance(result, BaseException):
            return result
    return None


class NodeLease(ZkLease):
    """A lease on one lock node, with what :meth:`ZooKeeperBackend.forget` needs: when the
    node was made, on the leader's clock (``ctime_ms``), whether the acquisition waited in
    line, and whether the node is timed (then the lease is valid for its ttl, not for as long
    as the session, and forgetting it changes nothing on the servers)."""

    def __init__(
        self, backend: Any, path: str, *, ctime_ms: int, waited: bool, timed: bool, **kwargs: Any
    ) -> None:
        self.ctime_ms = ctime_ms
        self.waited = waited
        self.timed = timed
        super().__init__(backend, path, **kwargs)

    def suspend(self, until: float) -> None:
        if not self.timed:  # a timed node does not end with the session
            super().suspend(until)

    def resume(self) -> None:
        if not self.timed:
            super().resume()

    def _expiry_reason(self) -> str:
        if self.timed:
            return f"its validity ran out (ttl {self.ttl:g} s on a timed node, not renewed)"
        return super()._expiry_reason()


class _Won(NamedTuple):
    """Where an acquisition ended up first in line."""

    path: str
    token: int  # its fencing token (see the module docstring)
    ctime_ms: int
    proven: float  # when the request that proved it (and the session) was sent
    waited: bool
    guard: _Guard


class _Entered(NamedTuple):
    """Our node, and the listing of its parent sent right after its create."""

    path: str
    stat: ZnodeStat
    received: float  # when the create's reply arrived (its ctime is the leader's "now")
    children: list[str]
    pzxid: int  # the parent's pzxid in that listing: the zxid of its last child change
    replaced: bool  # the parent's data was ever set: a replacement happened in this key


class _Guard:
    """Tells a holder that its node was deleted by someone else, at no cost when nothing
    happens to the key.

    The listing sent with the create carries a watch on the key's children (free: it rides on
    a request we send anyway). Until some child changes, our node is certainly still there.
    At the first change (a waiter queued, a node deleted) the guard sends one ``get`` with
    a watch on our own node, which from then on reports its deletion (an operator's release)
    as the lease's loss. A waiter sends that ``get`` together with the watch on its
    predecessor, while it waits, so nothing is left to send once it is admitted. So an
    uncontended cycle costs three requests (create, list, delete), as kazoo's own Lock does,
    and the first two share one round trip.
    """

    def __init__(self, client: KazooClient, session: SharedClient) -> None:
        self._client = client
        self._session = session
        self._lock = threading.Lock()
        self._lease: ZkLease | None = None
        self.path: str | None = None  # our node, once created
        self._fired = False  # the key's children changed since our listing
        self._armed = False  # a watch on our own node is set
        self._deleted = False  # our node was deleted before the lease existed

    @property
    def deleted(self) -> bool:
        """Our node was seen deleted before the acquisition won."""
        with self._lock:
            return self._deleted

    def cancel(self) -> None:
        """The acquisition gave up (refused, or failed): guard nothing from now on."""
        with self._lock:
            self.path = None

    def on_children(self, _event: WatchedEvent) -> None:
        with self._lock:
            self._fired = True
        self.watch_own()

    def attach(self, lease: ZkLease) -> None:
        """The acquisition won: guard ``lease`` (now, if its key changed meanwhile)."""
        with self._lock:
            self._lease = lease
            deleted = self._deleted
        if deleted:
            self._gone()
        else:
            self.watch_own()

    def watch_own(self, *, now: bool = False) -> None:
        """Set the watch on our own node, once (at once when ``now``, else only after the
        key's children changed)."""
        with self._lock:
            if self.path is None or self._armed or not (now or self._fired):
                return
            lease = self._lease
            if lease is not None and (lease.released or lease.lost):
                return
            self._armed = True
            path = self.path
        # Sent without waiting (this may run on kazoo's callback thread, which must not block).
        # A data watch (``get``), not ``exists``: an ``exists`` on a node already gone would
        # leave a watch for the creation of a name no sequential node ever takes again, kept by
        # the client and the servers for the rest of the session.
        self._client.get_async(path, watch=self._on_event).rawlink(self._on_reply)

    def _on_event(self, event: WatchedEvent) -> None:
        with self._lock:
            self._armed = False
        if event.type == EventType.DELETED:
            self._gone()
        elif event.type is not None:
            self.watch_own(now=True)  # data changed: keep watching

    def _on_reply(self, result: Any) -> None:
        try:
            result.get()
        except NoNodeError:
            self._gone()
        except KAZOO_ERRORS:
            return  # session trouble: the session listener reports it

    def _gone(self) -> None:
        with self._lock:
            lease = self._lease
            if lease is None:
                self._deleted = True  # a waiter's node: its next listing will miss it
                return
        if lease.released or lease.pid != forks.pid():
            return
        self._session.discard(lease)
        watchdog.discard(lease)
        lease.lose(  # on kazoo's watch thread: callbacks run elsewhere (see ZkLease.lose)
            "its lock node was deleted by another client (celery dlock release, or an operator)"
        )


#: Fresh attempts when a refusal found the first node gone before it could name its holder.
HEAD_VANISHED_RETRIES = 3


class _HeadVanished(Exception):
    """A refusal (``wait`` ran out) found the first node in line gone when it read its holder:
    released or replaced meanwhile. Our node is deleted; a fresh attempt may take the key, or
    name who holds it now."""

    def __init__(self, refusal: LockContended) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal


class _Reaper:
    """One daemon thread per process that runs jobs when due: deleting this process's
    forgotten nodes when their ttl is up (:meth:`ZooKeeperBackend.forget`). A job returns in
    how many seconds to run it again, or None; it gives up after ``TRIES`` runs (the key's
    next contender deletes the node then)."""

    TRIES = 20

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # the thread did not survive the fork

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, int, Callable[[], float | None]]] = []
        self._serial = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, due: float, job: Callable[[], float | None], tries: int = 0) -> None:
        """Run ``job`` at ``due`` (``time.monotonic()``)."""
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._serial), tries, job))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dlock-zk-reaper", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._heap:
                    self._cond.wait()
                    continue
                due, _, tries, job = self._heap[0]
                left = due - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._heap)
            try:
                again = job()
            except Exception:
                log.debug("timed node clean-up failed", exc_info=True)
                again = None
            if again is not None and tries + 1 < self.TRIES:
                self.add(time.monotonic() + again, job, tries + 1)


#: This process's clean-up thread for forgotten nodes.
reaper = _Reaper()


class _Attempt:
    """One acquisition under way: its node's create and the parent's listing, sent together
    and not yet read (so :meth:`ZooKeeperBackend.send_queued` can return before the replies)."""

    def __init__(
        self,
        backend: ZooKeeperBackend,
        key: str,
        ttl: float,
        holder: str | None,
        *,
        timed: bool,
        queued: bool,
        sender: Any,
    ) -> None:
        self.session, self.client = backend._client()
        self.key = key
        self.ttl = ttl
        self.holder = holder
        self.timed = timed
        self.queued = queued
        self.sender = sender
        self.nonce = secrets.token_urlsafe(15)
        self.parent = backend.parent(key)
        self.data = identity(
            self.nonce,
            holder,
            queued=queued,
            task=_task_name(sender),
            ttl=ttl if timed else None,
        ).encode()
        self.name_prefix = node_prefix(self.nonce, timed=timed, task=holder if queued else None)
        self.guard = _Guard(self.client, self.session)
        self.begun = time.monotonic()
        self.created: Any = None
        self.listing: Any = None
        self.send()

    def send(self) -> None:
        """Send our node's create and the parent's listing, back to back."""
        self.created = self.client.create_async(
            f"{self.parent}/{self.name_prefix}",
            self.data,
            acl=self.session.acl,
            ephemeral=not self.timed,
            sequence=True,
            include_data=True,
        )
        self.listing = self.client.get_children_async(
            self.parent, watch=self.guard.on_children, include_data=True
        )


class _Pending:
    """A queued lock's acquisition sent by :meth:`ZooKeeperBackend.send_queued`, not read yet."""

    def __init__(self, backend: ZooKeeperBackend, attempt: _Attempt) -> None:
        self.key = attempt.key
        self._backend = backend
        self._attempt = attempt

    @property
    def nonce(self) -> str:
        """The random nonce of the acquisition sent (whether or not it took the key)."""
        return self._attempt.nonce

    @property
    def token(self) -> str:
        """Older name of :attr:`nonce`."""
        return self.nonce

    def finish(self) -> Lease:
        """Read the replies: the lease, or raise LockContended / LockUnavailable."""
        return self._backend._finish(self._attempt, 0.0, None, None, None)


class ZooKeeperBackend:
    """Acquire and release leases on one ZooKeeper ensemble (a ``zookeeper://`` URL)."""

    #: An acquisition others can read is decided: never undone (see Backend.settle_time).
    settle_time = 0.0

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
        self.url: ZkUrl = parse(url.urls[0])
        prefix = url.prefix
        if "/" in prefix or prefix in (".", ".."):
            raise ConfigError(
                f"dlock_prefix {prefix!r} cannot name a ZooKeeper node: use a non-empty name "
                "without '/', e.g. 'dlock'."
            )
        self.prefix = prefix
        self.ttl = url.ttl
        self.drift_factor = url.drift_factor
        self.base = f"{self.url.chroot}/{prefix}"

    def __repr__(self) -> str:
        return f"<ZooKeeperBackend {self.url.shown} prefix={self.prefix!r}>"

    @property
    def shared(self) -> SharedClient:
        """This process's client for the ensemble (a new one after fork)."""
        return shared(self.url)

    def _client(self) -> tuple[SharedClient, KazooClient]:
        session = self.shared
        return session, session.start()

    def parent(self, key: str) -> str:
        """The key's parent node, under which its contenders queue."""
        return f"{self.base}/{_node_name(key)}"

    def _unavailable(self, key: str, doing: str, exc: BaseException) -> LockUnavailable:
        detail = str(exc) or type(exc).__name__
        if isinstance(exc, NoAuthError):
            # Nodes made with digest credentials carry an ACL for that user alone.
            user = self.url.user
            who = f"user {user!r}" if user is not None else "a client without credentials"
            detail = (
                f"{detail}: the ACL of the nodes under {self.base} does not let {who} in "
                "(another ZooKeeper user made them); put that user's credentials in the URL "
                "(zookeeper://user:password@hosts/chroot), or use another chroot"
            )
        return LockUnavailable(
            f"cannot {doing} {key!r} on ZooKeeper {self.url.shown}: {detail}",
            key=key,
            errors=[(self.url.shown, detail)],
        )

    # -- acquire ---------------------------------------------------------------------------

    # -- acquire ---------------------------------------------------------------------------

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
    ) -> ZkLease:
        """Take ``key``: ``wait=0`` raises :class:`LockContended` at once when it is held,
        ``wait=s`` queues up to ``s`` seconds (FIFO), ``wait=None`` without bound.

        A lease on a session node: no ttl bounds it, its node lasts while the session does,
        and its validity is confirmed every third of the session timeout (:class:`ZkLease`);
        ``ttl`` only times :meth:`forget`, and ``renew``/``renew_interval`` are accepted for
        the common signature and unused. ``queued=True`` takes a *timed* node instead, held
        for ``ttl`` whatever becomes of this process (a queued lock, enqueue-time mode).
        ``takeover`` (a task id) adopts that task's queued lock when it is first in line
        (see the module docstring). ``fence_retention`` is moot: the token is a zxid, never
        reset per key.
        """
        key = check_key(key)
        ttl = self.ttl if ttl is None else check_ttl("ttl", ttl, self.drift_factor)
        if wait is not None:
            wait = check_seconds("wait", wait, allow_zero=True)
        if max_hold is not None:
            max_hold = check_seconds("max_hold", max_hold)
        if holder is not None and not isinstance(holder, str):
            raise ConfigError(f"holder must be a str (a task id) or None, not {holder!r}.")
        if takeover is not None and not isinstance(takeover, str):
            raise ConfigError(f"takeover must be a str (a task id) or None, not {takeover!r}.")
        return self.acquire_checked(
            key,
            ttl,
            wait,
            holder=holder,
            interval=None,
            max_hold=max_hold,
            on_lost=on_lost,
            takeover=takeover,
            queued=queued,
            sender=sender,
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
    ) -> ZkLease:
        """:meth:`acquire` for arguments already checked."""
        attempt = _Attempt(self, key, ttl, holder, timed=queued, queued=queued, sender=sender)
        return self._finish(attempt, wait, None if queued else takeover, max_hold, on_lost)

    def send_queued(
        self, key: str, ttl: float, *, holder: str, sender: Any = None
    ) -> _Pending | None:
        """Send a queued lock's acquisition (a timed node's create and the listing) without
        waiting for the replies; :meth:`_Pending.finish` reads them. None when no server
        answers (the caller's :meth:`acquire` then reports it)."""
        try:
            attempt = _Attempt(self, key, ttl, holder, timed=True, queued=True, sender=sender)
        except LockUnavailable:
            return None
        return _Pending(self, attempt)

    def _finish(
        self,
        attempt: _Attempt,
        wait: float | None,
        takeover: str | None,
        max_hold: float | None,
        on_lost: LostCallback | None,
    ) -> NodeLease:
        """Read an attempt's replies, wait in line as ``wait`` allows, and make the lease."""
        for _ in range(HEAD_VANISHED_RETRIES):
            try:
                return self._finish_once(attempt, wait, takeover, max_hold, on_lost)
            except _HeadVanished as vanished:
                refusal = vanished.refusal
            attempt = _Attempt(
                self,
                attempt.key,
                attempt.ttl,
                attempt.holder,
                timed=attempt.timed,
                queued=attempt.queued,
                sender=attempt.sender,
            )
        raise refusal

    def _finish_once(
        self,
        attempt: _Attempt,
        wait: float | None,
        takeover: str | None,
        max_hold: float | None,
        on_lost: LostCallback | None,
    ) -> NodeLease:
        """:meth:`_finish` for one attempt (:class:`_HeadVanished`: make another)."""
        session, key = attempt.session, attempt.key
        try:
            entered = self._enter(attempt)
        except KAZOO_ERRORS as exc:
            raise self._unavailable(key, "lock", exc) from exc
        attempt.guard.path = entered.path
        try:
            won = self._queue(attempt, entered, wait, takeover)
        except (LockContended, _HeadVanished):
            raise  # our node is already deleted
        except BaseException:
            attempt.guard.cancel()
            self._abandon(attempt.client, session, entered.path)
            raise
        timed = attempt.timed
        if timed:
            deadline = attempt.begun + attempt.ttl - drift(attempt.ttl, self.drift_factor)
        else:
            deadline = won.proven + self._validity(session)
        lease = NodeLease(
            self,
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
            renew_interval=None if timed else session.negotiated / 3,
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

    def _enter(self, attempt: _Attempt) -> _Entered:
        """Our node and the parent's listing (one round trip, see the module docstring). A
        missing parent (a key's first use, or its container removed) is created, and the
        create sent again."""
        client, session, parent = attempt.client, attempt.session, attempt.parent
        timeout = session.op_timeout
        for _ in range(10):
            try:
                path, stat = attempt.created.get(timeout=timeout)
            except NoNodeError:
                self._make_parent(client, session, parent)
                attempt.send()
                continue
            except ConnectionLoss:
                # The create may have happened without its reply reaching us: find it by nonce.
                found = self._find(client, session, parent, attempt.nonce)
                if found is None:
                    raise
                path, stat = found
                attempt.listing = client.get_children_async(
                    parent, watch=attempt.guard.on_children, include_data=True
                )
            received = time.monotonic()
            try:
                children, listed = attempt.listing.get(timeout=timeout)
            except (NoNodeError, ConnectionLoss):  # listed before the parent was made, or lost
                children, listed = [], None
            if path.rsplit("/", 1)[1] not in children:
                watched = partial(
                    client.get_children_async,
                    parent,
                    watch=attempt.guard.on_children,
                    include_data=True,
                )
                children, listed = session.call(watched)
            pzxid = max(int(stat.czxid), int(listed.pzxid) if listed is not None else 0)
            replaced = listed is not None and int(listed.version) > 0
            return _Entered(path, stat, received, list(children), pzxid, replaced)
        raise LockUnavailable(
            f"cannot lock {attempt.key!r}: its parent node {parent} keeps vanishing",
            key=attempt.key,
        )

    def _make_parent(self, client: KazooClient, session: SharedClient, parent: str) -> None:
        """Create a key's parent as a container node (and the base path, persistent)."""
        acl = session.acl or OPEN_ACL_UNSAFE
        for _ in range(3):
            result = client.handler.async_result()
            # kazoo has no call for createContainer: send its request as kazoo's create does.
            client._call(_CreateContainer(parent, b"", acl, CONTAINER), result)
            try:
                result.get(timeout=session.op_timeout)
                return
            except NodeExistsError:
                return
            except NoNodeError:
                client.ensure_path_async(self.base, session.acl).get(timeout=session.op_timeout)

    @staticmethod
    def _find(
        client: KazooClient,
        session: SharedClient,
        parent: str,
        nonce: str,
        *,
        replacement: bool = False,
    ) -> tuple[str, ZnodeStat] | None:
        """The child made by the acquisition ``nonce`` (its replacement, when ``replacement``:
        a child whose name inherits an order), with its stat; None when there is none."""
        try:
            children = session.call(lambda: client.get_children_async(parent))
        except NoNodeError:
            return None
        for child in children:
            parsed = parse_name(child)
            if parsed is None or parsed.nonce != nonce:
                continue
            if replacement and parsed.order == parsed.seq:
                continue
            path = f"{parent}/{child}"
            stat = session.call(partial(client.exists_async, path))
            return (path, stat) if stat is not None else None
        return None

    def _stamp(self, client: KazooClient, session: SharedClient) -> tuple[int, float]:
        """A fresh stamp of the leader's clock (ms): the ``mtime`` of an empty ``setData`` on
        the base node above every key (nobody watches its data; a key's parent's data
        version counts replacements, see the module docstring), and when its reply arrived."""
        stat = session.call(partial(client.set_async, self.base, b""))
        return int(stat.mtime), time.monotonic()

    @staticmethod
    def _reap(client: KazooClient, session: SharedClient, path: str, version: int) -> None:
        """Delete an expired timed node, if it is still the version we read."""
        try:
            session.call(partial(client.delete_async, path, version))
            log.debug("deleted expired timed node %s", path)
        except KAZOO_ERRORS:
            pass  # gone, changed (adopted), or unreachable: the caller lists again

    def _read(
        self, client: KazooClient, session: SharedClient, path: str, watch: Any = None
    ) -> tuple[bytes, ZnodeStat] | None:
        """A node's data and stat, None when it is gone."""
        try:
            raw, stat = session.call(partial(client.get_async, path, watch=watch))
        except NoNodeError:
            return None
        return raw, stat

    def _queue(
        self,
        attempt: _Attempt,
        entered: _Entered,
        wait: float | None,
        takeover: str | None,
    ) -> _Won:
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
        path = entered.path
        name = path.rsplit("/", 1)[1]
        children = entered.children
        pzxid = entered.pzxid  # of the last listing
        replaced = entered.replaced  # ... and whether it showed a replacement ever happened
        czxid = int(entered.stat.czxid)
        proven = attempt.begun  # the create's send time
        # The freshest stamp of the leader's clock, and when its reply arrived here.
        now_ms, now_at = int(entered.stat.ctime), entered.received
        mine = task_hash(takeover) if takeover else None
        waited = False
        for _ in range(1_000_000):
            line = in_line(children)
            names = [n.name for n in line]
            if name not in names:
                raise LockUnavailable(
                    f"cannot lock {key!r}: our queue node {name} vanished (session expired, "
                    "or deleted by an operator)",
                    key=key,
                )
            position = names.index(name)
            if position == 0:
                # The token (module docstring): our node's czxid while the key never had a
                # replacement, else the pzxid of the listing that shows us first.
                token = pzxid if replaced else czxid
                return _Won(path, token, int(entered.stat.ctime), proven, waited, attempt.guard)
            head = line[0]
            if mine is not None and head.task == mine:
                adopted = self._adopt(attempt, head, path, waited)
                if adopted is not None:
                    return adopted
            elif deadline is not None and time.monotonic() >= deadline:
                if not head.timed:
                    attempt.guard.cancel()
                    raise self._contended(client, session, key, parent, head.name, name)
                refusal = self._refuse_timed(attempt, head, path, now_ms)
                if refusal is not None:
                    raise refusal
            else:
                waited = True
                shortcut = position == 1 and not replaced
                now_ms, now_at, proven, done = self._wait_behind(
                    attempt, line[position - 1], shortcut, deadline, now_ms, now_at, proven
                )
                if done:
                    return _Won(path, czxid, int(entered.stat.ctime), proven, True, attempt.guard)
            try:
                asked = time.monotonic()
                children, listed = session.call(
                    lambda: client.get_children_async(parent, include_data=True)
                )
                pzxid = int(listed.pzxid)
                replaced = int(listed.version) > 0
                proven = asked
            except KAZOO_ERRORS as exc:
                raise self._unavailable(key, "wait for", exc) from exc
        raise LockUnavailable(f"cannot lock {key!r}: its line never settled", key=key)

    def _refuse_timed(
        self, attempt: _Attempt, head: NodeName, path: str, now_ms: int
    ) -> LockContended | None:
        """``wait`` ran out behind a timed node: delete it if expired (None: look again), else
        the refusal naming its holder (our node deleted)."""
        client, session = attempt.client, attempt.session
        head_path = f"{attempt.parent}/{head.name}"
        try:
            found = self._read(client, session, head_path)
        except KAZOO_ERRORS as exc:
            raise self._unavailable(attempt.key, "lock", exc) from exc
        if found is None:
            return None
        raw, stat = found
        if expires_ms(raw, stat, self.ttl) <= now_ms:
            self._reap(client, session, head_path, stat.version)
            return None
        attempt.guard.cancel()
        self._abandon(client, session, path)
        holder = read_holder(raw, stat)
        who = holder.describe() if holder else "another contender"
        return LockContended(
            f"lock {attempt.key!r} is held by {who}", key=attempt.key, holder=holder
        )

    def _wait_behind(
        self,
        attempt: _Attempt,
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
        (only with ``shortcut``: see below); else the caller lists again."""
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
            guard.watch_own(now=True)  # sent with the next request: ready once admitted
            asked = time.monotonic()
            wake_at: float | None = None
            watching = False
            if predecessor.timed:
                found = self._read(client, session, pred_path, watch=wake)
                if found is not None:
                    raw, stat = found
                    left_ms = expires_ms(raw, stat, self.ttl) - now_ms
                    if left_ms <= 0:
                        self._reap(client, session, pred_path, stat.version)
                        return now_ms, now_at, asked, False
                    watching = True
                    # Counted from when the stamp's reply arrived: the expiry comes no
                    # earlier on this clock, so we wake late rather than early.
                    wake_at = now_at + left_ms / 1000.0
            else:
                # A data watch (``get``): ``exists`` on a predecessor already gone would leave
                # a watch that never fires (see _Guard.watch_own), one per such race.
                watching = self._read(client, session, pred_path, watch=wake) is not None
            proven = asked
            if watching:
                limits = [t for t in (deadline, wake_at) if t is not None]
                woken.wait(None if not limits else max(0.0, min(limits) - time.monotonic()))
            if wake_at is not None and not woken.is_set() and time.monotonic() >= wake_at:
                now_ms, now_at = self._stamp(client, session)
                return now_ms, now_at, proven, False
            deleted = any(e.type == EventType.DELETED for e in events)
            fresh = time.monotonic() - proven < session.negotiated / 3
            # The short cut: our listing came after our create, so it showed every node
            # ahead of ours; only the predecessor was, first in line. It was deleted, not
            # replaced (a replacement sets its data first: a change, not a deletion), and
            # only the first node is ever replaced: ours is first now. With no replacement
            # ever in this key, our czxid is our token (module docstring), so no listing is
            # needed, saving a round trip on every hand-over between waiters. After a long
            # wait the listing is sent anyway: its answer is the fresh proof of the session
            # the lease's validity needs.
            done = shortcut and deleted and fresh and not guard.deleted
            return now_ms, now_at, proven, done
        except KAZOO_ERRORS as exc:
            raise self._unavailable(attempt.key, "wait for", exc) from exc
        finally:
            with session.lock:
                session.waiters.discard(woken)

    def _adopt(self, attempt: _Attempt, head: NodeName, path: str, waited: bool) -> _Won | None:
        """Take over the queued lock ``head`` of our own task: one transaction creates our
        session node in its place (its order) and deletes it and our first node. None when
        it failed (the queued lock is gone: the caller lists again)."""
        client, session, parent = attempt.client, attempt.session, attempt.parent
        head_path = f"{parent}/{head.name}"
        transaction = client.transaction()
        transaction.create(
            f"{parent}/{node_prefix(attempt.nonce, order=head.order)}",
            attempt.data,
            acl=session.acl,
            ephemeral=True,
            sequence=True,
        )
        # A waiter watching the queued lock sees a change, not a deletion: it lists again.
        transaction.set_data(head_path, b"")
        transaction.delete(head_path)
        transaction.delete(path)
        transaction.set_data(parent, b"")  # the key has had a replacement (module docstring)
        asked = time.monotonic()
        try:
            results = transaction.commit_async().get(timeout=session.op_timeout)
        except ConnectionLoss:
            return self._settle(attempt, path, asked, waited)
        except KAZOO_ERRORS as exc:
            raise self._unavailable(attempt.key, "adopt the queued lock of", exc) from exc
        if _failed(results) is not None:
            return None
        new_path, stat = results[0], results[1]
        # Every operation of a multi has the transaction's zxid and time: the setData's stat
        # carries the replacement's czxid (our token: we are first from that zxid on) and
        # its ctime.
        return self._adopted(attempt, new_path, int(stat.mzxid), int(stat.mtime), asked, waited)

    def _settle(self, attempt: _Attempt, path: str, asked: float, waited: bool) -> _Won | None:
        """An adoption whose reply was lost: find out whether it happened."""
        client, session = attempt.client, attempt.session
        try:
            found = self._find(client, session, attempt.parent, attempt.nonce, replacement=True)
        except KAZOO_ERRORS as exc:
            raise self._unavailable(attempt.key, "adopt the queued lock of", exc) from exc
        if found is None:
            return None  # not applied: our first node is still in line
        new_path, stat = found
        return self._adopted(attempt, new_path, int(stat.czxid), int(stat.ctime), asked, waited)

    def _adopted(
        self, attempt: _Attempt, path: str, czxid: int, ctime_ms: int, asked: float, waited: bool
    ) -> _Won:
        attempt.guard.cancel()  # its node went with the transaction: no loss to report
        guard = _Guard(attempt.client, attempt.session)
        guard.path = path
        guard.watch_own(now=True)
        log.debug("key=%s: adopted the queued lock of %s", attempt.key, attempt.holder)
        return _Won(path, czxid, ctime_ms, asked, waited, guard)

    def _contended(
        self,
        client: KazooClient,
        session: SharedClient,
        key: str,
        parent: str,
        lowest: str,
        name: str,
    ) -> LockContended:
        """The refusal, with the holder read while our node is deleted (one round trip)."""
        path = f"{parent}/{lowest}"
        sent = [client.get_async(path)]
        deleting = client.delete_async(f"{parent}/{name}")
        holder: Holder | None = None
        vanished = False
        try:
            raw, stat = session.call(lambda: sent.pop() if sent else client.get_async(path))
            holder = read_holder(raw, stat)
        except NoNodeError:
            # Released, or replaced (a beat's tick key made timed right after it was taken):
            # the caller tries again rather than refuse without naming a holder.
            vanished = True
        except KAZOO_ERRORS:
            holder = None  # unreadable: the refusal stands
        try:
            deleting.get(timeout=session.op_timeout)
        except NoNodeError:
            pass
        except KAZOO_ERRORS:
            session.owe(f"{parent}/{name}")
        who = holder.describe() if holder else "another contender"
        refusal = LockContended(f"lock {key!r} is held by {who}", key=key, holder=holder)
        if vanished:
            raise _HeadVanished(refusal)
        return refusal

    @staticmethod
    def _abandon(client: KazooClient, session: SharedClient, path: str) -> None:
        """Delete our queue node after a refusal or an error (owed until it lands)."""
        try:
            client.delete_async(path).get(timeout=session.op_timeout)
        except NoNodeError:
            pass
        except KAZOO_ERRORS:
            session.owe(path)

    # -- end a lease -----------------------------------------------------------------------

    def release(self, lease: Lease, *, wait: bool = True) -> bool:
        """Delete the lease's node; True if the delete was confirmed. Idempotent, never
        raises for an unreachable ensemble: an unconfirmed delete is sent again when the
        connection is back (and the node goes with the session anyway)."""
        assert isinstance(lease, ZkLease)
        session = self.shared
        with lease.io_lock:
            lease.notice_expiry()
            if not lease.set_released():
                return False
            watchdog.discard(lease)
            session.discard(lease)
            if lease.pid != forks.pid():
                return False  # the parent's lease, inherited by fork: the parent releases it
            confirmed: bool | None = None
            try:
                result = session.start().delete_async(lease.path)
                if wait:
                    result.get(timeout=session.op_timeout)
                    confirmed = True
                else:
                    result.rawlink(self._owe_if_failed(session, lease.path))
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
        lock_released.send(
            sender=lease.sender,
            key=lease.key,
            token=lease.token,
            task_id=lease.holder,
            held_for=time.monotonic() - lease.acquired_at,
            confirmed=confirmed,
        )
        return bool(confirmed)

    @staticmethod
    def _owe_if_failed(session: SharedClient, path: str) -> Callable[[Any], None]:
        def check(result: Any) -> None:
            try:
                result.get()
            except NoNodeError:
                pass
            except KAZOO_ERRORS:
                session.owe(path)

        return check

    def _validity(self, session: SharedClient) -> float:
        """How long after sending a request that is answered the session surely lives."""
        return session.negotiated - drift(session.negotiated, self.drift_factor)

    def renew(self, leases: Sequence[Lease]) -> list[str | None]:
        """Confirm each lease's node with one ``exists`` (all sent together): the answer moves
        its validity on (see :class:`ZkLease`); no answer is undecided (None), the watchdog
        tries again until the validity runs out; a missing node is a loss."""
        session = self.shared
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
                out.append(
                    "its lock node is gone (deleted by another client, or its session expired)"
                )
            else:
                lease.renewed(started, started + self._validity(session))
                out.append(None)
        return out

    def _replace(
        self,
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
        session = self.shared
        client = session.start()
        parent, name = lease.path.rsplit("/", 1)
        parsed = parse_name(name)
        order = parsed.order if parsed is not None else int(name[-SEQ_DIGITS:])
        deadline = time.monotonic() + session.op_timeout

        def applied() -> tuple[str, ZnodeStat] | None:
            found = self._find(client, session, parent, nonce, replacement=True)
            return None if found is None or found[0] == lease.path else found

        while True:
            transaction = client.transaction()
            transaction.create(
                f"{parent}/{node_prefix(nonce, timed=True, task=queued_for, order=order)}",
                data,
                acl=session.acl,
                sequence=True,
            )
            # The waiter behind sees a change: it lists again.
            transaction.set_data(lease.path, b"")
            transaction.delete(lease.path)
            transaction.set_data(parent, b"")  # the key has had a replacement (module docstring)
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
            if _failed(results) is not None:
                # The replaced node is gone: deleted, or replaced by an earlier copy of this
                # very transaction that did apply after all.
                return applied()
            return results[0], results[1]

    def forget(self, lease: Lease) -> None:
        """Stop tracking ``lease`` without releasing it: its key lives out its ttl even if this
        process ends (a beat tick key). A session node is replaced by a timed node in its place
        in line, living ``ttl`` from the session node's creation (from the replacement's, if
        the acquisition waited in line: its ttl then counts from when it got the key, later);
        a timed node (a queued lock) is simply left to its ttl. This process also deletes a
        forgotten session lease's node at its expiry if it is still running (one thread,
        :data:`reaper`); else the key's next contender does."""
        assert isinstance(lease, ZkLease)
        session = self.shared
        with lease.io_lock:
            if not lease.set_released():
                return
            watchdog.discard(lease)
            session.discard(lease)
            if lease.pid != forks.pid():
                return
            timed = isinstance(lease, NodeLease) and lease.timed
            path: str | None = lease.path
            if not timed and isinstance(lease, NodeLease):
                anchor = None if lease.waited else lease.ctime_ms
                data = timed_data(lease.head, lease.ttl, anchor)
                try:
                    replaced = self._replace(lease, head_nonce(lease.head), data, queued_for=None)
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
        reaper.add(lease.acquired_at + lease.ttl, partial(self._reap_at_expiry, path, lease.ttl))

    def _reap_at_expiry(self, path: str, ttl: float) -> float | None:
        """Delete a forgotten node once expired on the leader's clock (a session node left by
        a failed replacement: at once). Returns in how many seconds to look again (not yet
        expired, or no server answered), or None when done."""
        session = self.shared
        try:
            client = session.start()
            found = self._read(client, session, path)
            if found is None:
                return None
            raw, stat = found
            if stat.ephemeralOwner:
                self._reap(client, session, path, stat.version)
                return None
            now_ms, _ = self._stamp(client, session)
            left_ms = expires_ms(raw, stat, ttl) - now_ms
            if left_ms <= 0:
                self._reap(client, session, path, stat.version)
                return None
            return left_ms / 1000.0
        except UNREACHABLE:
            return session.negotiated / 3

    def hand_over(self, lease: Lease, ttl: float) -> str | None:
        """Turn ``lease`` into the queued lock of its own task's next message (a retry): its
        node is replaced, in one transaction, by a timed node in its place in line, adoptable
        by that task id, living ``ttl``. Returns the queued lock's nonce (for the message to
        carry), or None when the lease was no longer held. The queued lock's fencing token
        (its czxid) is larger than the lease's: see the module docstring."""
        assert isinstance(lease, ZkLease)
        session = self.shared
        nonce = secrets.token_urlsafe(15)
        with lease.io_lock:
            lease.notice_expiry()
            if not lease.set_released():
                return None
            watchdog.discard(lease)
            session.discard(lease)
            if lease.pid != forks.pid() or lease.holder is None:
                return None
            data = identity(
                nonce, lease.holder, queued=True, task=_task_name(lease.sender), ttl=ttl
            ).encode()
            try:
                replaced = self._replace(lease, nonce, data, queued_for=lease.holder)
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
                reaper.add(time.monotonic(), partial(self._reap_at_expiry, lease.path, ttl))
                return None
        if replaced is None:
            return None
        log.debug("handed key=%s over to the queued retry of %s", lease.key, lease.holder)
        return nonce

    # -- operators -------------------------------------------------------------------------

    def _nodes(self, key: str) -> tuple[KazooClient, SharedClient, str, list[NodeName]]:
        """The key's parent and its children in line order (empty when none)."""
        session, client = self._client()
        parent = self.parent(key)
        try:
            children = client.get_children_async(parent).get(timeout=session.op_timeout)
        except NoNodeError:
            children = []
        except KAZOO_ERRORS as exc:
            raise self._unavailable(key, "inspect", exc) from exc
        return client, session, parent, in_line(list(children))

    def _holder_node(self, key: str) -> tuple[str, Holder, int | None] | None:
        """The holder's node, identity and (a timed node) ms of life left; None when nobody
        holds ``key``. An expired timed node found first in line is deleted on the way."""
        for _ in range(5):  # a release between the listing and the read: list again
            client, session, parent, children = self._nodes(key)
            if not children:
                return None
            head = children[0]
            path = f"{parent}/{head.name}"
            try:
                stamp = client.set_async(self.base, b"") if head.timed else None
                raw, stat = client.get_async(path).get(timeout=session.op_timeout)
                now_ms = int(stamp.get(timeout=session.op_timeout).mtime) if stamp else 0
            except NoNodeError:
                continue
            except KAZOO_ERRORS as exc:
                raise self._unavailable(key, "inspect", exc) from exc
            left: int | None = None
            if head.timed:
                left = expires_ms(raw, stat, self.ttl) - now_ms
                if left <= 0:
                    self._reap(client, session, path, stat.version)
                    continue
            holder = read_holder(raw, stat)
            if holder is not None:
                return path, holder, left
            return None
        return None

    def holder(self, key: str) -> Holder | None:
        """The current holder (the first node's identity), or None when nobody holds ``key``."""
        found = self._holder_node(check_key(key))
        return found[1] if found else None

    def inspect(self, key: str) -> LockInfo:
        """The key's holder; the time left only for a timed node (a session node's lease
        lasts as long as its session)."""
        found = self._holder_node(check_key(key))
        if found is None:
            return LockInfo(key, None, None, None)
        _, holder, left = found
        return LockInfo(key, holder, None if left is None else left / 1000.0, holder.fence)

    def queue(self, key: str) -> list[Holder]:
        """The holder and every waiter of ``key``, in the order they will hold it."""
        client, session, parent, children = self._nodes(check_key(key))
        reads = [client.get_async(f"{parent}/{child.name}") for child in children]
        out: list[Holder] = []
        for read in reads:
            try:
                raw, stat = read.get(timeout=session.op_timeout)
            except NoNodeError:
                continue
            holder = read_holder(raw, stat)
            if holder is not None:
                out.append(holder)
        return out

    def locks(self, prefix: str = "") -> list[LockInfo]:
        """Every key starting with ``prefix`` that has a parent node (free keys included)."""
        session, client = self._client()
        try:
            names = client.get_children_async(self.base).get(timeout=session.op_timeout)
        except NoNodeError:
            names = []
        except KAZOO_ERRORS as exc:
            raise self._unavailable(prefix, "list locks", exc) from exc
        keys = sorted(k for k in (unquote(n) for n in names) if k.startswith(prefix))
        return [self.inspect(key) for key in keys]

    def _delete_if(self, key: str, match: Callable[[NodeName, Holder], bool]) -> bool:
        """Delete the holder's node if ``match(its parsed name, holder)``; True if deleted."""
        found = self._holder_node(key)
        if found is None:
            return False
        parsed = parse_name(found[0].rsplit("/", 1)[1])
        if parsed is None or not match(parsed, found[1]):
            return False
        session, client = self._client()
        try:
            client.delete_async(found[0]).get(timeout=session.op_timeout)
        except NoNodeError:
            return False
        except KAZOO_ERRORS as exc:
            raise self._unavailable(key, "release", exc) from exc
        return True

    def force_release(self, key: str, holder: Holder) -> bool:
        """Delete ``holder``'s node: its watch tells the holder its lease is lost, and the
        next waiter is admitted."""
        key = check_key(key)
        released = self._delete_if(key, lambda name, h: name.nonce == holder.nonce)
        if released:
            log.warning("forced release of key=%s held by %s", key, holder.describe())
        return released

    def release_nonce(self, key: str, nonce: str) -> bool:
        """Delete the node of the acquisition with ``nonce`` on ``key``: the holder's, or a
        waiter's (its process ended, and its place in line would hold up those behind it
        until its session expired)."""
        key = check_key(key)
        if self._delete_if(key, lambda name, h: name.nonce == nonce):
            return True
        client, session, parent, children = self._nodes(key)
        for child in children[1:]:
            if child.nonce == nonce:
                try:
                    client.delete_async(f"{parent}/{child.name}").get(timeout=session.op_timeout)
                except NoNodeError:
                    return False
                except KAZOO_ERRORS as exc:
                    raise self._unavailable(key, "release", exc) from exc
                return True
        return False

    def release_by_task(self, key: str, task_id: str) -> bool:
        """Delete ``key``'s node if task ``task_id`` holds it, whichever acquisition."""
        return self._delete_if(check_key(key), lambda name, h: h.task_id == task_id)

    #: Older names (the Redis backend keeps them too).
    release_token = release_nonce
    release_by_holder = release_by_task

    def purge(self, prefix: str) -> list[str]:
        """Force-release every held key starting with ``prefix``; the keys released."""
        return [
            info.key
            for info in self.locks(prefix)
            if info.holder is not None and self.force_release(info.key, info.holder)
        ]

    def endpoints(self) -> list[str]:
        """One line per server of the ensemble, credentials hidden, with the chroot."""
        who = f"{self.url.user}:***@" if self.url.user is not None else ""
        return [
            f"zookeeper://{who}{host if ':' not in host else f'[{host}]'}:{port}{self.base}"
            for host, port in self.url.hosts
        ]

    def check(self) -> list[tuple[str, str | None]]:
        """Ask each server whether it serves clients (``srvr``, allowed by ZooKeeper's
        default four-letter-word whitelist): ``(endpoint, error)``, None when it does."""
        out: list[tuple[str, str | None]] = []
        for endpoint, (host, port) in zip(self.endpoints(), self.url.hosts, strict=True):
            try:
                with socket.create_connection((host, port), timeout=self.url.timeout) as sock:
                    sock.sendall(b"srvr")
                    answer = b""
                    while chunk := sock.recv(4096):
                        answer += chunk
            except OSError as exc:
                out.append((endpoint, str(exc) or type(exc).__name__))
                continue
            text = answer.decode(errors="replace")
            if "Mode:" in text:
                out.append((endpoint, None))
            else:
                out.append(
                    (endpoint, text.strip().splitlines()[0] if text.strip() else "no answer")
                )
        return out

    def close(self) -> None:
        """Nothing of its own to close: the process's client is shared (see
        :func:`celery_dlock.zookeeper.session.close_all`)."""
