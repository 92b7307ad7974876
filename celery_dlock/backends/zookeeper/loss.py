"""How a holder learns that its lock node was deleted by someone else (an operator's ``celery
dlock release``): a watch on its own node, set only once the key's children changed."""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, NoNodeError
from kazoo.protocol.serialization import int_struct, write_string
from kazoo.protocol.states import EventType, KeeperState, WatchedEvent

from celery_dlock.backends.zookeeper.lease import ZkLease
from celery_dlock.backends.zookeeper.session import KAZOO_ERRORS, SharedClient
from celery_dlock.core import forks
from celery_dlock.core.renewal import watchdog

#: ZooKeeper's watcher type for a children watch, in a removeWatches request.
CHILDREN_WATCH = 1


class _RemoveWatches:
    """ZooKeeper's ``removeWatches`` request (opcode 18, ZooKeeper 3.5+; kazoo has no call for
    it): the path and the watcher type; an empty reply."""

    type = 18

    def __init__(self, path: str, watcher_type: int) -> None:
        self.path = path
        self.watcher_type = watcher_type

    def serialize(self) -> bytearray:
        out = bytearray()
        out.extend(write_string(self.path))
        out.extend(int_struct.pack(self.watcher_type))
        return out

    @classmethod
    def deserialize(cls, _buffer: bytes, _offset: int) -> bool:
        return True


class Guard:
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

    def stop_children_watch(self, parent: str) -> None:
        """We wait in line: take back the watch on the key's children that our listing set.

        A waiter watches its predecessor and its own node; the children watch was only for a
        holder admitted at once. Left armed (nobody joined after us), it would wake this
        process too at the holder's release, besides the waiter that is admitted. Sent
        without waiting for the reply, with the request that sets the predecessor's watch;
        not sent when another acquisition of this process shares the watch (the servers keep
        one per session and path), or when it fired already."""
        with self._lock:
            if self._fired:
                return
            self._fired = True  # no more use for it: watch_own is set by the wait
        full = f"{self._client.chroot}{parent}" if self._client.chroot else parent
        watchers = self._client._child_watchers.get(full)
        if watchers is None or self.on_children not in watchers:
            return
        watchers.discard(self.on_children)
        if watchers:
            return
        self._client._child_watchers.pop(full, None)
        result = self._client.handler.async_result()
        self._client._call(_RemoveWatches(full, CHILDREN_WATCH), result)
        result.rawlink(partial(_removed, self._client, full, parent))

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
        except ConnectionLoss:
            # Sent, and its reply lost with the connection: no watch was set. The renewal
            # no longer looks at each node (one request per session), so set it again (kazoo
            # holds the request until the same session is back).
            with self._lock:
                self._armed = False
            self.watch_own(now=True)
        except KAZOO_ERRORS:
            return  # the session is over: the session listener reports it

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


def _removed(client: KazooClient, full: str, parent: str, result: Any) -> None:
    """The reply to a ``removeWatches`` of the children watch on ``full``: its error (no
    watch left to remove) changes nothing, but a listing of this session that the servers
    answered before the removal (another acquisition's, sent between our listing and our
    removal) had its watch taken too: the servers keep one per session and path. Its
    watchers, registered when its reply came, before this one, are told as of a change (a
    holder then watches its own node), or a forced release would go unnoticed. Watchers of
    listings answered after the removal are told too, once, needlessly but harmlessly. A
    lost reply changes nothing: kazoo sets every registered watch again on reconnection."""
    try:
        result.get()
    except ConnectionLoss:
        return
    except KAZOO_ERRORS:
        pass
    orphans = client._child_watchers.pop(full, None)
    if not orphans:
        return
    event = WatchedEvent(EventType.CHILD, KeeperState.CONNECTED, parent)
    for watcher in orphans:
        watcher(event)
