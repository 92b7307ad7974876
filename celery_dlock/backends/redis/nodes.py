"""Lock nodes: one Redis master (plain or Sentinel-managed), its scripts, its per-thread
connections and what celery_dlock keeps on each connection (:class:`ConnState`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import redis
from redis.commands.core import Script
from redis.exceptions import ConnectionError as RedisConnectionError

from celery_dlock.backends.redis import endpoints, failover, scripts
from celery_dlock.core import forks
from celery_dlock.core.errors import ConfigError

#: The logger operators know for connection problems with one node (docs/operations.md),
#: shared with every module that talks to the nodes (:mod:`.transport`, :mod:`.sending` and
#: those below them).
log = logging.getLogger("celery_dlock.transport")

#: A node's answer: the script's reply, or the exception that stood in for it.
Reply = Any
#: A redis-py ``Connection``; typed loosely because redis-py leaves most of its methods untyped.
Connection = Any


class Cluster(Protocol):
    """What the fan-out needs of a whole Redis Cluster (:class:`.cluster.ClusterNode`),
    which builds on this module and :mod:`.transport` and so cannot be named here."""

    def reload_later(self) -> None: ...

    def run(self, name: str, keys: Sequence[str], args: Sequence[Any], timeout: float) -> Reply: ...


class ConnState:
    """What celery_dlock keeps on one of its redis-py connections, as ``conn._dlock``.

    Made with the connection (:meth:`Node.connection`), so the hot path of every lock cycle
    reaches it with one attribute lookup. ``known``, ``poll`` and ``skip`` describe the server
    behind one socket: they hold only for ``sock``, and :meth:`on` clears them once the
    connection has a new socket (a reconnect may reach a restarted server, or another one).
    ``owed`` and ``sent`` outlive a socket: the reply machinery empties ``owed`` when its socket
    dies, and each ``sent`` entry names the socket it went out on.
    """

    __slots__ = ("known", "node", "owed", "poll", "sent", "skip", "sock", "tls")

    def __init__(self, node: Node) -> None:
        #: The node the connection belongs to (the janitor resends on it).
        self.node = node
        #: The socket ``known``, ``poll`` and ``skip`` belong to.
        self.sock: Any = None
        #: Scripts the server has run since ``sock`` connected: safe to send by SHA.
        self.known: set[str] = set()
        #: A ``select.poll`` object with ``sock`` registered (one per call cost more than the
        #: poll itself).
        self.poll: Any = None
        #: Whether ``sock`` is a TLS socket (set with ``poll``).
        self.tls = False
        #: Whether the server honours ``CLIENT REPLY SKIP`` on ``sock``; None: not asked yet.
        self.skip: bool | None = None
        #: Commands sent whose replies are still to be read, in order (``owed.Owed``).
        self.owed: list[Any] = []
        #: Reply-less commands not yet confirmed by a later reply (``resends.Sent``); None
        #: until the connection first carries one.
        self.sent: list[Any] | None = None

    def on(self, sock: Any) -> ConnState:
        """This state, its socket-bound parts cleared if they belong to another socket."""
        if sock is not self.sock:
            self.sock = sock
            self.known = set()
            self.poll = None
            self.skip = None
        return self


#: Unconfirmed reply-less commands of connections closed with their thread, for the janitor
#: (:func:`celery_dlock.backends.redis.resends.overdue`): the node, and what to send again.
orphans: list[tuple[Node, Any]] = []


class Identities:
    """Which server each node of one Redlock group reached, by its ``INFO server`` ``run_id``
    (new at each server start): two nodes that reach one server are one vote counted twice,
    whatever their names (``127.0.0.1`` and ``localhost``, a DNS alias, a port forward)."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self._order = {id(node): i for i, node in enumerate(nodes)}  # as the URLs are listed
        self._lock = threading.Lock()
        self._by_run_id: dict[str, Node] = {}
        self._of: dict[int, str] = {}  # id(node) -> its server's run_id

    def verify(self, node: Node, conn: Connection) -> None:
        """Ask the server behind a new connection of ``node`` who it is; a
        :class:`ConfigError` naming both URLs if another node of the group reached it. A
        server that will not say (``INFO`` denied by an ACL) is not checked."""
        try:
            conn.send_command("INFO", "server")
            info = conn.read_response()
        except redis.ResponseError:
            return
        text = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
        run_id = next(
            (
                line.split(":", 1)[1].strip()
                for line in text.splitlines()
                if line.startswith("run_id:")
            ),
            "",
        )
        if not run_id:
            return
        with self._lock:
            other = self._by_run_id.get(run_id)
            if other is not None and other is not node and self._of.get(id(other)) == run_id:
                conn.disconnect()
                first, second = sorted((node, other), key=lambda n: self._order.get(id(n), 0))
                raise ConfigError(
                    f"dlock_urls: {first.shown!r} and {second.shown!r} reach the same Redis "
                    f"server (its INFO server run_id is {run_id}), so Redlock would count one "
                    "server's vote twice and a majority would not be one; list each server once "
                    "(independent masters on different hosts)."
                )
            self._by_run_id[run_id] = node
            self._of[id(node)] = run_id


class Node:
    """One Redis master: a redis-py client, its scripts, and one connection per thread.

    Also the base of :class:`celery_dlock.backends.redis.cluster.ClusterNode` (a whole Redis Cluster
    as one lock node), which routes each call to a
    :class:`celery_dlock.backends.redis.cluster.Shard`, itself a ``Node`` for one master of the
    cluster.
    """

    #: True for a ``ClusterNode``: calls must be routed by the hash slot of their keys.
    cluster = False
    #: The ``ClusterNode`` a ``Shard`` belongs to (None for a plain node); see :class:`Cluster`.
    owner: Node | None = None
    #: True for a :class:`SentinelNode`: its master can change under open connections.
    watched = False
    #: The Redlock group whose servers must all differ (:class:`Identities`); None alone.
    group: Identities | None = None

    def __init__(self, url: str, timeout: float, prefix: str = "dlock") -> None:
        self.url = url
        self.prefix = prefix  # the keys' prefix, for error messages about ACL key patterns
        self.endpoint = endpoints.parse(url)
        self._setup(self.endpoint.shown, timeout, self.endpoint.client(timeout))

    def _setup(self, shown: str, timeout: float, client: redis.Redis) -> None:
        self.shown = shown
        self.timeout = timeout
        self.client = client
        self.scripts: dict[str, Script] = {
            name: client.register_script(source) for name, source in scripts.ALL.items()
        }
        self._local = threading.local()
        #: Connections of ended threads, by purpose, for the next thread's first use.
        self._idle: dict[str, list[Connection]] = {}
        self._closed = False  # by close(): an ended thread's connections are closed then
        self._pid = forks.pid()
        self._down_until = 0.0

    @property
    def down(self) -> bool:
        """True for a while after the node failed to answer (see :meth:`mark_down`)."""
        return self._down_until > time.monotonic()

    def mark_down(self) -> None:
        """Skip this node for a short cool-down after a timeout or connection failure.

        With several nodes, a hung one would otherwise cost every call (and the renewal
        watchdog) a timeout or a new connection attempt. Skipping it only ever counts it as
        failed, which is never less safe; one call tries it again after the cool-down, and a
        call that could not reach a majority without it tries it at once (see
        :func:`celery_dlock.backends.redis.transport.run_script`).
        """
        self._down_until = time.monotonic() + max(0.5, 2 * self.timeout)

    def __repr__(self) -> str:
        return f"<Node {self.shown}>"

    def _new_connection(self) -> Connection:
        pool = self.client.connection_pool
        conn: Connection = pool.connection_class(**pool.connection_kwargs)
        conn._dlock = ConnState(self)
        return conn

    def connection(self, purpose: str = "cmd") -> Connection:
        """This thread's connection for ``purpose`` ("cmd", or "wait" for blocking pops).

        A thread keeps its connection until it ends; then the connection is kept for the next
        thread's first use (:meth:`_recycle`) rather than closed. Under gevent and eventlet a
        "thread" is a greenlet, and the pools run each task in a new one: so a worker opens
        about as many connections as it runs tasks at once, not one per task.
        """
        if self._pid != forks.pid():
            # A forked child must not share the parent's sockets: start afresh.
            self._local = threading.local()
            self._idle = {}
            self._pid = forks.pid()
        try:  # on every command: the usual case first
            conn: Connection = self._local.conns[purpose]
            return conn
        except (AttributeError, KeyError):
            pass
        conns: _ThreadConnections | None = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = _ThreadConnections(self)
        conn = conns.get(purpose)
        if conn is None:
            try:
                conn = self._idle[purpose].pop()
            except (KeyError, IndexError):
                conn = self._new_connection()
            conns[purpose] = conn
        return conn

    def _recycle(self, conns: dict[str, Connection], pid: int) -> bool:
        """Keep an ended thread's connections for other threads; False if they cannot be
        (made before a fork): then the caller closes them.

        A connection keeps its state (:class:`ConnState`) with it: replies it still owes are
        read before its next command, whoever sends it, and reply-less releases it has not
        had confirmed are confirmed by its next reply or sent again by the janitor, as for a
        thread that stops using a connection without ending.
        """
        if self._closed or pid != self._pid or pid != forks.pid():
            return False
        for purpose, conn in conns.items():
            self._idle.setdefault(purpose, []).append(conn)
        return True

    def drop_connection(self, purpose: str = "cmd") -> None:
        """Forget this thread's connection for ``purpose``; a new one is made on next use."""
        conns: _ThreadConnections | None = getattr(self._local, "conns", None)
        if conns is not None:
            conn = conns.pop(purpose, None)
            if conn is not None:
                _orphan_sent(conn)

    def close(self) -> None:
        """Close this thread's connections, those kept from ended threads, and the client's
        pool."""
        self._closed = True
        self._close_connections()
        self.client.close()

    def _close_connections(self) -> None:
        conns: _ThreadConnections | None = getattr(self._local, "conns", None)
        if conns is not None:
            conns.close()
        idle, self._idle = self._idle, {}
        for kept in idle.values():
            for conn in kept:
                conn.disconnect()
                _orphan_sent(conn)

    def route(self, key: str) -> Node:
        """The node that holds ``key``: this one (a ``ClusterNode`` picks its shard)."""
        return self

    def switched(self, conn: Connection) -> bool:
        """True if ``conn`` reaches a server its sentinels no longer call master."""
        return False

    def overtaken(self, conn: Connection) -> bool:
        """True if the sentinels name ``conn``'s server master under a newer configuration
        than the master this process heard announced (:class:`SentinelNode`)."""
        return False


#: Hear Sentinel's ``+switch-master`` announcements (:mod:`celery_dlock.backends.redis.failover`);
#: tests turn it off to show what the other failover signals (``READONLY``, closed connections) do
#: alone.
HEAR_SWITCHES = True
#: Called with a :class:`SentinelNode` when its sentinels announce a new master (the renewal
#: watchdog renews that node's leases at once).
switch_hooks: list[Callable[[Node], None]] = []


class SentinelNode(Node):
    """The master of a Sentinel-managed group, which can change while connections are open.

    Each process listens for the sentinels' ``+switch-master`` announcements
    (:class:`celery_dlock.backends.redis.failover.SwitchWatch`). Once one names a new master, a
    connection to any other address is dropped before its next command and opened again through the
    sentinels; one that the sentinels still send elsewhere (a sentinel lagging behind the
    announcement) fails, unsent, rather than act on the old master, unless a sentinel names
    that master under a newer configuration epoch than the announcement's (a failover this
    process did not hear: :meth:`overtaken`). A script refused with
    ``READONLY`` (a master demoted by ``REPLICAOF`` keeps its clients) also drops the
    connection and asks the sentinels again
    (:func:`celery_dlock.backends.redis.transport.run_script`).
    """

    watched = True

    def __init__(self, url: str, timeout: float, prefix: str = "dlock") -> None:
        super().__init__(url, timeout, prefix)
        self.service = self.endpoint.service
        #: The master address last announced by a sentinel, with the configuration epoch the
        #: announcing sentinel gave for it (None if it could not be asked); None until one is.
        self._announcement: tuple[tuple[str, int], int | None] | None = None
        self._watch: Any = None
        self._watch_pid = 0

    def __repr__(self) -> str:
        return f"<SentinelNode {self.shown}>"

    def connection(self, purpose: str = "cmd") -> Connection:
        if self._watch_pid != forks.pid():
            self._start_watch()
        return super().connection(purpose)

    def _start_watch(self) -> None:
        with _watch_lock:
            if self._watch_pid == forks.pid():
                return
            self._watch_pid = forks.pid()
            if HEAR_SWITCHES:
                manager = cast(Any, self.client.connection_pool).sentinel_manager
                self._watch = failover.SwitchWatch(self, manager)

    @property
    def announcement(self) -> tuple[tuple[str, int], int | None] | None:
        """The master address last announced by a sentinel and the configuration epoch the
        announcing sentinel gave for it (None if it could not be asked); None until one is."""
        return self._announcement

    @property
    def announced(self) -> tuple[str, int] | None:
        """The master address last announced by a sentinel; None until one is."""
        announcement = self._announcement
        return announcement[0] if announcement is not None else None

    def switched_to(self, address: tuple[str, int], epoch: int | None = None) -> None:
        """A sentinel announced ``address`` as the master (:mod:`.failover`), under
        configuration epoch ``epoch`` (None: unknown). An announcement older than the one
        heard before (a lower epoch, from a sentinel that lags) is ignored."""
        before = self._announcement
        if before is not None:
            known = before[1]
            if epoch is not None and known is not None and epoch < known:
                log.info(
                    "%s: a sentinel announced %s:%d under an older configuration (epoch %d < "
                    "%d); ignored",
                    self.shown,
                    *address,
                    epoch,
                    known,
                )
                return
            if address == before[0]:  # every sentinel announces the same switch
                if epoch is not None and (known is None or epoch > known):
                    self._announcement = (address, epoch)
                return
        self._announcement = (address, epoch)
        log.warning(
            "%s: the sentinels announced a new master, %s:%d; connections to any other "
            "address are dropped before their next command",
            self.shown,
            *address,
        )
        self._switched()

    def overtaken(self, conn: Connection) -> bool:
        announcement = self._announcement
        if announcement is None:
            return True
        manager = cast(Any, self.client.connection_pool).sentinel_manager
        address = (conn.host, conn.port)
        epoch = failover.newer_master(manager, self.service, announcement, address)
        if epoch is None:
            return False
        self._announcement = (address, epoch)
        log.warning(
            "%s: the sentinels now name %s:%d master under a newer configuration (epoch %d) "
            "than %s:%d, the master last announced here: an announcement was missed "
            "(not yet subscribed, or the subscriptions were down); following them",
            self.shown,
            *address,
            epoch,
            *announcement[0],
        )
        self._switched()
        return True

    def _switched(self) -> None:
        for hook in switch_hooks:
            try:
                hook(self)
            except Exception:
                log.exception("switch hook %r failed", hook)

    def switched(self, conn: Connection) -> bool:
        announced = self.announced
        return (
            announced is not None
            and getattr(conn, "_sock", None) is not None
            and (conn.host, conn.port) != announced
        )

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
            self._watch_pid = 0
        super().close()


_watch_lock = threading.Lock()


def _after_fork() -> None:
    global _watch_lock
    _watch_lock = threading.Lock()  # another thread may have held it at the fork
    orphans.clear()  # the parent's: its janitor sends them


os.register_at_fork(after_in_child=_after_fork)


class MasterSwitched(RedisConnectionError):
    """A Sentinel node's connection reached a server its sentinels no longer call master (a
    sentinel behind the announcement named it again, or it answered ``READONLY``): nothing
    was sent there."""

    dlock_unsent = True


def connect(node: Node, conn: Connection) -> None:
    """``conn.connect()``, refusing a Sentinel node's connection to a master since replaced."""
    conn.connect()
    if node.watched and node.switched(conn) and not node.overtaken(conn):
        conn.disconnect()
        raise MasterSwitched(
            f"{node.shown}: a sentinel still names {conn.host}:{conn.port}, but another "
            "master was announced; not sending there"
        )
    group = node.group
    if group is not None:
        group.verify(node, conn)


def reconnect(node: Node, conn: Connection) -> None:
    conn.disconnect()
    connect(node, conn)


class _ThreadConnections(dict[str, Connection]):
    """One thread's connections to one node, handed to the node for other threads when the
    thread ends (:meth:`Node._recycle`), or closed.

    A thread's ``threading.local`` data is dropped by reference counting when the thread
    exits, so ``__del__`` runs then (a greenlet's too, under gevent and eventlet); redis-py
    connections themselves sit in reference cycles and would otherwise wait for the cycle
    collector, leaking their sockets until it runs.
    """

    def __init__(self, node: Node) -> None:
        super().__init__()
        self.node = node
        self.pid = forks.pid()

    def close(self) -> None:
        for conn in self.values():
            conn.disconnect()
            _orphan_sent(conn)
        self.clear()

    def __del__(self) -> None:
        try:
            if self and self.node._recycle(self, self.pid):
                self.clear()
                return
        except Exception:  # at interpreter exit, modules go first
            pass
        self.close()


def _orphan_sent(conn: Connection) -> None:
    """Hand the reply-less releases ``conn`` sent but never saw confirmed to the janitor: a
    connection this thread lets go of will not confirm them now, and they are sent again."""
    state: ConnState | None = getattr(conn, "_dlock", None)
    if state is not None and state.sent:
        with contextlib.suppress(Exception):  # at interpreter exit, modules go first
            orphans.extend((state.node, entry[0]) for entry in state.sent)
        state.sent.clear()


def is_connected(conn: Connection) -> bool:
    return getattr(conn, "_sock", None) is not None
