"""Leases on a ZooKeeper ensemble: the lock recipe with ephemeral sequential nodes.

The recipe (https://zookeeper.apache.org/doc/current/recipes.html#sc_recipes_Locks): each
contender creates an *ephemeral sequential* node under the key's parent node; the lowest
sequence number holds the lock; a waiter watches only the node just before its own (no herd
effect: a release wakes one waiter), so waiters are admitted in arrival (FIFO) order. ::

    <chroot>/<prefix>/<quoted key>/<nonce>-0000000042   data: the holder's identity (JSON)

* **Cost.** The create and the listing of the parent are sent back to back on the session's
  connection, which ZooKeeper answers in order, so the listing already shows our node: taking a
  free key is one create and one list in one round trip; a refusal (``wait=0``) adds the read
  of the holder's identity and the delete of our node, again in one round trip.
* **Fencing token** = the lock node's ``czxid``, the id of the transaction that created it.
  ZooKeeper's leader stamps every write with a zxid (epoch in the high 32 bits, a counter in
  the low 32) and every server applies writes in zxid order, so zxids strictly increase across
  the whole ensemble, through leader changes (a new leader starts a higher epoch)
  (https://zookeeper.apache.org/doc/current/zookeeperInternals.html#sc_guaranteesPropertiesDefinitions).
  Holders of a key hold it in sequence-number order, which is creation order, so each holder's
  token exceeds every earlier holder's. It does not survive wiping the ensemble's data.
* **Identity.** The node's data is one line of JSON (the random nonce, task id, task name,
  host, pid, start time, queued flag) that ``celery dlock`` reads; the nonce also prefixes the
  node's name, so a create whose reply was lost is found again (the recipe's "recoverable
  errors" advice) and an operator's release names one acquisition.
* **Loss.** The holder watches its own node: a delete by anyone else (``celery dlock
  release``) reports the lease lost. Validity follows the session (:class:`ZkLease`); session
  states map onto it as described in :mod:`celery_dlock.zookeeper.session`.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any
from urllib.parse import quote, unquote

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, NoNodeError
from kazoo.protocol.states import EventType, WatchedEvent, ZnodeStat

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
from celery_dlock.holder import Holder, LockInfo
from celery_dlock.lease import Lease, LostCallback
from celery_dlock.renewal import watchdog
from celery_dlock.signals import lock_acquired, lock_released
from celery_dlock.zookeeper.lease import ZkLease
from celery_dlock.zookeeper.session import KAZOO_ERRORS, UNREACHABLE, SharedClient, shared
from celery_dlock.zookeeper.url import ZkUrl, parse

log = logging.getLogger("celery_dlock.zookeeper")

#: Digits ZooKeeper appends to a sequential node's name.
SEQ_DIGITS = 10


def _seq(name: str) -> int:
    return int(name[-SEQ_DIGITS:])


def _node_name(key: str) -> str:
    """``key`` as one znode name: percent-quoted ('/' and all), never '.' or '..'."""
    name = quote(key, safe="")
    return name.replace(".", "%2E") if name in (".", "..") else name


def _task_name(sender: Any) -> str | None:
    name = getattr(sender, "name", None)
    return name if isinstance(name, str) else None


def identity(
    nonce: str, holder: str | None, *, queued: bool = False, task: str | None = None
) -> str:
    """The JSON a lock node holds (the same fields as a Redis lock value, fence excepted:
    the fence is the node's czxid, known only once the node exists)."""
    data: dict[str, Any] = {"token": nonce, "holder": holder}
    if queued:
        data["queued"] = True
    if task is not None:
        data["task"] = task
    data["host"] = socket.gethostname()
    data["pid"] = forks.pid()
    data["since"] = int(time.time() * 1000)
    return json.dumps(data, separators=(",", ":"))


def read_holder(raw: bytes | None, stat: ZnodeStat) -> Holder | None:
    """A lock node's data and stat as a :class:`Holder` (fence = czxid); None if unreadable."""
    try:
        data = json.loads(raw or b"")
        return Holder(
            token=str(data["token"]),
            holder=None if data.get("holder") is None else str(data["holder"]),
            host=str(data.get("host", "?")),
            pid=int(data.get("pid", 0)),
            since=float(data.get("since", 0)) / 1000.0,
            fence=int(stat.czxid),
            queued=data.get("queued") is True,
            task=None if data.get("task") is None else str(data["task"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


class _Guard:
    """Tells a holder that its node was deleted by someone else, at no cost when nothing
    happens to the key.

    The listing sent with the create carries a watch on the key's children (free: it rides on
    a request we send anyway). Until some child changes, our node is certainly still there.
    At the first change (a waiter queued, a node deleted) the guard sends one ``exists`` with
    a watch on our own node, which from then on reports its deletion (an operator's release)
    as the lease's loss. A waiter sends that ``exists`` together with the watch on its
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
        self._client.exists_async(path, watch=self._on_event).rawlink(self._on_reply)

    def _on_event(self, event: WatchedEvent) -> None:
        with self._lock:
            self._armed = False
        if event.type == EventType.DELETED:
            self._gone()
        elif event.type is not None:
            self.watch_own(now=True)  # data changed: keep watching

    def _on_reply(self, result: Any) -> None:
        try:
            exists = result.get() is not None
        except KAZOO_ERRORS:
            return  # session trouble: the session listener reports it
        if not exists:
            self._gone()

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


class ZooKeeperBackend:
    """Acquire and release leases on one ZooKeeper ensemble (a ``zookeeper://`` URL)."""

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
        return LockUnavailable(
            f"cannot {doing} {key!r} on ZooKeeper {self.url.shown}: {detail}",
            key=key,
            errors=[(self.url.shown, detail)],
        )

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

        No ttl bounds a ZooKeeper lease: its node lasts while the session does, and its
        validity is confirmed every third of the session timeout (:class:`ZkLease`); ``ttl``
        only times :meth:`forget`, and ``renew``/``renew_interval`` are accepted for the
        common signature and unused. ``fence_retention`` is moot: the token is a zxid, never
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
        if takeover or queued:
            raise ConfigError(
                "queued locks (lock_on='enqueue', a retry handing its key over) are not yet "
                "supported on ZooKeeper: they must outlive the publishing process's session."
            )
        session, client = self._client()
        begun = time.monotonic()
        nonce = secrets.token_urlsafe(15)
        parent = self.parent(key)
        data = identity(nonce, holder, task=_task_name(sender)).encode()
        guard = _Guard(client, session)
        try:
            path, stat, children = self._enter(client, session, parent, nonce, data, guard)
        except KAZOO_ERRORS as exc:
            raise self._unavailable(key, "lock", exc) from exc
        name = path.rsplit("/", 1)[1]
        guard.path = path
        try:
            proven = self._queue(client, session, key, parent, name, children, wait, begun, guard)
        except LockContended:
            raise  # our node is already deleted (see _contended)
        except BaseException:
            guard.cancel()
            self._abandon(client, session, path)
            raise
        lease = ZkLease(
            self,
            path,
            key=key,
            token=int(stat.czxid),
            head=data.decode(),
            holder=holder,
            ttl=ttl,
            started=proven,
            deadline=proven + self._validity(session),
            renew_interval=session.negotiated / 3,
            max_hold=max_hold,
            sender=sender,
        )
        if on_lost is not None:
            lease.on_lost(on_lost)
        session.add(lease)
        watchdog.add(lease)  # confirms the session every third of its timeout (renew())
        guard.attach(lease)
        waited_for = time.monotonic() - begun
        log.debug("acquired key=%s token=%s waited=%.3f", key, lease.token, waited_for)
        lock_acquired.send(
            sender=sender, key=key, token=lease.token, task_id=holder, waited=waited_for
        )
        return lease

    def _enter(
        self,
        client: KazooClient,
        session: SharedClient,
        parent: str,
        nonce: str,
        data: bytes,
        guard: _Guard,
    ) -> tuple[str, ZnodeStat, list[str]]:
        """Create our node and list the parent, in one round trip (see the module docstring)."""
        timeout = session.op_timeout
        created = client.create_async(
            f"{parent}/{nonce}-",
            data,
            acl=session.acl,
            ephemeral=True,
            sequence=True,
            makepath=True,
            include_data=True,
        )
        listing = client.get_children_async(parent, watch=guard.on_children)
        try:
            path, stat = created.get(timeout=timeout)
        except ConnectionLoss:
            # The create may have happened without its reply reaching us: find it by nonce.
            found = self._find(client, session, parent, nonce)
            if found is None:
                raise
            path, stat = found
            listing = client.get_children_async(parent, watch=guard.on_children)
        try:
            children = list(listing.get(timeout=timeout))
        except (NoNodeError, ConnectionLoss):  # listed before makepath made the parent, or lost
            children = []
        if path.rsplit("/", 1)[1] not in children:
            watched = partial(client.get_children_async, parent, watch=guard.on_children)
            children = list(session.call(watched))
        return path, stat, children

    @staticmethod
    def _find(
        client: KazooClient, session: SharedClient, parent: str, nonce: str
    ) -> tuple[str, ZnodeStat] | None:
        try:
            children = session.call(lambda: client.get_children_async(parent))
        except NoNodeError:
            return None
        for child in children:
            if child.startswith(f"{nonce}-"):
                path = f"{parent}/{child}"
                stat = session.call(partial(client.exists_async, path))
                return (path, stat) if stat is not None else None
        return None

    def _queue(
        self,
        client: KazooClient,
        session: SharedClient,
        key: str,
        parent: str,
        name: str,
        children: list[str],
        wait: float | None,
        begun: float,
        guard: _Guard,
    ) -> float:
        """Wait until our node is the lowest. Returns when the last request that showed it
        was sent (the session surely lives until then + its timeout: see :class:`ZkLease`).
        Raises LockContended when ``wait`` runs out (our node is then deleted)."""
        deadline = None if wait is None else begun + wait
        proven = begun  # the create's send time
        while True:
            ordered = sorted(children, key=_seq)
            if name not in ordered:
                raise LockUnavailable(
                    f"cannot lock {key!r}: our queue node {name} vanished (session expired, or "
                    "deleted by an operator)",
                    key=key,
                )
            position = ordered.index(name)
            if position == 0:
                return proven
            if deadline is not None and time.monotonic() >= deadline:
                guard.cancel()
                raise self._contended(client, session, key, parent, ordered[0], name)
            woken = threading.Event()
            events: list[WatchedEvent] = []
            predecessor = f"{parent}/{ordered[position - 1]}"

            def wake(
                event: WatchedEvent,
                woken: threading.Event = woken,
                events: list[WatchedEvent] = events,
            ) -> None:
                events.append(event)
                woken.set()

            try:
                with session.lock:
                    session.waiters.add(woken)
                guard.watch_own(now=True)  # sent with the next request: ready once admitted
                asked = time.monotonic()
                watching = session.call(partial(client.exists_async, predecessor, watch=wake))
                proven = asked
                if watching is not None:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    woken.wait(left)
                gone = watching is None or any(e.type == EventType.DELETED for e in events)
                fresh = time.monotonic() - proven < session.negotiated / 3
                if position == 1 and gone and fresh and not guard.deleted:
                    # Our listing came after our create, so it showed every node older than
                    # ours; only the predecessor was, and no older node can appear later. It
                    # is gone: ours is the lowest, no need to list again (saves a round trip
                    # on every hand-over). After a long wait the listing is sent anyway: its
                    # answer is the fresh proof of the session the lease's validity needs.
                    return proven
                asked = time.monotonic()
                children = list(session.call(lambda: client.get_children_async(parent)))
                proven = asked
            except KAZOO_ERRORS as exc:
                raise self._unavailable(key, "wait for", exc) from exc
            finally:
                with session.lock:
                    session.waiters.discard(woken)

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
        try:
            raw, stat = session.call(lambda: sent.pop() if sent else client.get_async(path))
            holder = read_holder(raw, stat)
        except KAZOO_ERRORS:
            holder = None  # released meanwhile, or unreadable: the refusal stands
        try:
            deleting.get(timeout=session.op_timeout)
        except NoNodeError:
            pass
        except KAZOO_ERRORS:
            with session.lock:
                session.owed.add(f"{parent}/{name}")
        who = holder.describe() if holder else "another contender"
        return LockContended(f"lock {key!r} is held by {who}", key=key, holder=holder)

    @staticmethod
    def _abandon(client: KazooClient, session: SharedClient, path: str) -> None:
        """Delete our queue node after a refusal or an error (owed until it lands)."""
        try:
            client.delete_async(path).get(timeout=session.op_timeout)
        except NoNodeError:
            pass
        except KAZOO_ERRORS:
            with session.lock:
                session.owed.add(path)

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
                with session.lock:
                    session.owed.add(lease.path)
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
                with session.lock:
                    session.owed.add(path)

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

    def forget(self, lease: Lease) -> None:
        """Stop tracking ``lease`` without releasing it now; its node is deleted after its
        ttl (a one-shot key such as a beat tick), or with the session if this process ends
        first."""
        assert isinstance(lease, ZkLease)
        if not lease.set_released():
            return
        watchdog.discard(lease)
        self.shared.discard(lease)
        if lease.pid != forks.pid():
            return
        timer = threading.Timer(
            max(0.0, lease.acquired_at + lease.ttl - time.monotonic()),
            self._delete_quietly,
            (lease.path,),
        )
        timer.daemon = True
        timer.start()

    def _delete_quietly(self, path: str) -> None:
        session = self.shared
        try:
            session.start().delete_async(path).get(timeout=session.op_timeout)
        except NoNodeError:
            pass
        except UNREACHABLE:
            with session.lock:
                session.owed.add(path)

    def hand_over(self, lease: Lease, ttl: float) -> str | None:
        """Not yet on ZooKeeper (a queued lock must outlive this process's session)."""
        raise ConfigError("handing a key over to a queued retry is not yet supported on ZooKeeper.")

    # -- operators -------------------------------------------------------------------------

    def _nodes(self, key: str) -> tuple[KazooClient, SharedClient, str, list[str]]:
        """The key's parent and its children in queue order (empty when none)."""
        session, client = self._client()
        parent = self.parent(key)
        try:
            children = client.get_children_async(parent).get(timeout=session.op_timeout)
        except NoNodeError:
            children = []
        except KAZOO_ERRORS as exc:
            raise self._unavailable(key, "inspect", exc) from exc
        return client, session, parent, sorted(children, key=_seq)

    def _holder_node(self, key: str) -> tuple[str, Holder] | None:
        """The holder's node and identity; None when nobody holds ``key``."""
        for _ in range(5):  # a release between the listing and the read: list again
            client, session, parent, children = self._nodes(key)
            if not children:
                return None
            path = f"{parent}/{children[0]}"
            try:
                raw, stat = client.get_async(path).get(timeout=session.op_timeout)
            except NoNodeError:
                continue
            except KAZOO_ERRORS as exc:
                raise self._unavailable(key, "inspect", exc) from exc
            holder = read_holder(raw, stat)
            if holder is not None:
                return path, holder
            return None
        return None

    def holder(self, key: str) -> Holder | None:
        """The current holder (the lowest node's identity), or None when nobody holds ``key``."""
        found = self._holder_node(check_key(key))
        return found[1] if found else None

    def inspect(self, key: str) -> LockInfo:
        """The key's holder; no ttl (a ZooKeeper lease lasts as long as its session)."""
        key = check_key(key)
        holder = self.holder(key)
        return LockInfo(key, holder, None, holder.fence if holder else None)

    def queue(self, key: str) -> list[Holder]:
        """The holder and every waiter of ``key``, in the order they will hold it."""
        client, session, parent, children = self._nodes(check_key(key))
        reads = [client.get_async(f"{parent}/{child}") for child in children]
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

    def _delete_if(self, key: str, match: Callable[[str, Holder], bool]) -> bool:
        """Delete the holder's node if ``match(node name, holder)``; True if deleted."""
        found = self._holder_node(key)
        if found is None or not match(found[0].rsplit("/", 1)[1], found[1]):
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
        released = self._delete_if(key, lambda name, h: name.startswith(f"{holder.nonce}-"))
        if released:
            log.warning("forced release of key=%s held by %s", key, holder.describe())
        return released

    def release_nonce(self, key: str, nonce: str) -> bool:
        """Delete ``key``'s node if the acquisition with ``nonce`` holds it."""
        return self._delete_if(check_key(key), lambda name, h: name.startswith(f"{nonce}-"))

    def release_by_task(self, key: str, task_id: str) -> bool:
        """Delete ``key``'s node if task ``task_id`` holds it, whichever acquisition."""
        return self._delete_if(check_key(key), lambda name, h: h.task_id == task_id)

    #: Older names (the Redis backend keeps them too).
    release_token = release_nonce
    release_by_holder = release_by_task

    def send_queued(self, key: str, ttl: float, *, holder: str, sender: Any = None) -> None:
        """None: a queued lock is not sent ahead on ZooKeeper (see :meth:`hand_over`)."""
        return

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
