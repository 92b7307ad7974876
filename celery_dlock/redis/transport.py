"""Talking to Redis nodes: one script sent to every node at once, replies gathered by a deadline.

Redlock's safety depends on contacting all masters within the validity window, so a call must
not visit nodes one after another. Instead of a thread per node (whose hand-offs and GIL
contention cost more than the round trip itself on a busy worker), each thread keeps one
connection per node, packs the command once, writes it to every socket, then reads the replies
against one shared deadline: N nodes cost one round trip plus N small writes and reads.

Connections are redis-py ``Connection`` objects built from the node's pool settings, so URL
options, TLS, authentication and the hiredis parser work as in redis-py. Scripts are redis-py
``Script`` objects registered on each node's client; their SHA is what we send.

The nodes and their connections are :mod:`celery_dlock.redis.nodes`; a Redis Cluster
(:mod:`celery_dlock.redis.cluster`) routes each call to one of its masters, then uses this module.
"""

from __future__ import annotations

import logging
import os
import select
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, cast

from redis.commands.core import Script
from redis.exceptions import (
    AskError,
    NoScriptError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_dlock.background import ProcessPool
from celery_dlock.redis.nodes import (
    Cluster,
    Connection,
    ConnState,
    MasterSwitched,
    Node,
    Reply,
    connect,
    is_connected,
    orphans,
    reconnect,
)

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:  # redis-py's own serializer wraps this C packer in Python that costs more than it does
    import hiredis

    _hiredis_pack = hiredis.pack_command
except ImportError:  # pragma: no cover - hiredis is optional (the "fast" extra)
    _hiredis_pack = None

log = logging.getLogger("celery_dlock.transport")


def _demoted(reply: Reply) -> bool:
    """True for a reply that says the server is no longer a master: redis-py's own conversion
    of ``READONLY`` (Redis 7) or the ``ResponseError`` a script gets on Redis 6.2."""
    if isinstance(reply, ResponseError):
        return "READONLY" in str(reply)
    return isinstance(reply, RedisConnectionError) and "now a slave" in str(reply)


class CoolingDown(RedisConnectionError):
    """A node skipped during its cool-down: nothing was sent to it."""

    dlock_unsent = True


def unsent(reply: Reply) -> bool:
    """True for a failure that happened before anything was sent (cool-down, no connection):
    that node cannot run the command late."""
    return bool(getattr(reply, "dlock_unsent", False))


#: Opens several connections in parallel, so that nodes which accept TCP but never answer
#: delay a call by one timeout, not one per node. Only ever runs ``connect()``, never waits on
#: itself, so it cannot deadlock; its threads start on demand, and there are enough that one
#: caller's connects (the watchdog's) do not queue behind many others'.
_connector = ProcessPool("dlock-connect", 64)


def _connect_all(
    nodes: Sequence[Node], conns: Sequence[Connection], replies: list[Reply], timeout: float
) -> None:
    """Connect every connection that is not, giving up after ``timeout``; a failure becomes
    that node's reply."""
    todo = [i for i, conn in enumerate(conns) if replies[i] is _PENDING and not is_connected(conn)]
    if not todo:
        return
    if len(todo) == 1:
        i = todo[0]
        try:
            connect(nodes[i], conns[i])
        except (RedisError, OSError) as exc:
            exc.dlock_unsent = True  # type: ignore[union-attr]
            replies[i] = exc
        return
    pool = _connector.get()
    begun = time.monotonic()
    futures: dict[int, Future[None]] = {}
    try:
        for i in todo:
            futures[i] = pool.submit(connect, nodes[i], conns[i])
        for i, future in futures.items():
            try:
                failure = future.exception(timeout=max(timeout - (time.monotonic() - begun), 0.0))
            except FutureTimeout:
                _give_up(nodes[i], conns[i], future)
                failure = RedisTimeoutError(f"connecting to {nodes[i].shown} took too long")
            if failure is not None:
                failure.dlock_unsent = True  # type: ignore[attr-defined]
                replies[i] = failure
    except BaseException:
        # Interrupted (a soft time limit, LockLost): the connects still running would go on
        # beside this thread's next command on the same connection (AUTH, SELECT unanswered).
        for i, future in futures.items():
            if not future.done():
                _give_up(nodes[i], conns[i], future)
        raise


def _give_up(node: Node, conn: Connection, future: Future[None]) -> None:
    """Still connecting in the background: the thread never uses that connection object
    again, and it is closed once the connect ends, or its socket would stay open with nobody
    to close it."""
    future.add_done_callback(_closer(conn))
    node.drop_connection()


def _closer(conn: Connection) -> Callable[[Future[Any]], None]:
    """A callback that closes ``conn`` when a connect given up on finally ends."""
    return lambda _: conn.disconnect()


_PENDING = object()


def _stale(conn: Connection) -> bool:
    """True if an idle connection has data or EOF waiting: it can no longer be trusted.

    One ``poll()`` on the socket; our connections never leave a reply unread in the parser.
    With TLS, decrypted bytes can wait in the TLS layer where ``poll()`` does not see them.
    """
    sock = getattr(conn, "_sock", None)
    if sock is None:
        return False
    try:
        # One poll object per socket, kept on the connection: making one per call cost
        # more than the poll itself, on every acquire and every release.
        state: ConnState = conn._dlock
        poller = state.poll
        if poller is None or state.sock is not sock:
            state.on(sock)
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            state.poll = poller
            state.tls = isinstance(sock, ssl.SSLSocket)
        if state.tls and _tls_pending(sock):
            return True
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def run_script(
    nodes: Sequence[Node],
    name: str,
    keys: Sequence[str],
    args: Sequence[Any],
    timeout: float,
) -> list[Reply]:
    """Run script ``name`` on every node at once; one reply (or exception) per node, in order.

    Returns after every node has answered or ``timeout`` seconds have passed; a node that is
    slower counts as failed with a ``TimeoutError`` (its connection is dropped, so a late reply
    can never be mistaken for the answer to a later command). Nodes that forgot the script
    (restart, ``SCRIPT FLUSH``) get its source in a second round, again all at once.
    """
    if len(nodes) == 1:
        node = nodes[0]
        if node.cluster:  # a Cluster is always the only node (config.check_urls)
            return [cast(Cluster, node).run(name, keys, args, timeout)]
        if not node.watched:
            return [_run_one(node, name, keys, args, timeout)]
    conns = [node.connection() for node in nodes]
    replies: list[Reply] = [_PENDING] * len(nodes)
    several = len(nodes) > 1
    if several:
        cooling = [i for i, node in enumerate(nodes) if node.down]
        # Skip cooling nodes only while the others can still make a majority: nodes that
        # failed one after the other would otherwise refuse every call until the last
        # cool-down ends, even with all of them back. Then every node is tried: with a
        # majority really down, a call costs one timeout, as it would without cool-downs.
        if cooling and len(nodes) - len(cooling) >= len(nodes) // 2 + 1:
            for i in cooling:
                replies[i] = CoolingDown(f"{nodes[i].shown} is cooling down after a failure")
    _connect_all(nodes, conns, replies, timeout)
    todo = [i for i, reply in enumerate(replies) if reply is _PENDING]
    if not todo:
        return replies
    script = nodes[0].scripts[name]
    packed = _pack(conns[todo[0]], ("EVALSHA", script.sha, len(keys), *keys, *args))
    _exchange(nodes, conns, todo, packed, timeout, replies)
    _send_source(nodes, conns, todo, script, keys, args, timeout, replies)
    demoted = [i for i in todo if nodes[i].watched and _demoted(replies[i])]
    if demoted:
        _ask_again(nodes, conns, demoted, packed, timeout, replies)
        _send_source(nodes, conns, demoted, script, keys, args, timeout, replies)
        for i in demoted:
            if _demoted(replies[i]):  # the sentinels still name a replica: nothing was done
                conns[i].disconnect()
                replies[i] = MasterSwitched(f"{nodes[i].shown}: the master is a replica now")
    if several:
        for i in todo:
            if isinstance(replies[i], RedisConnectionError | RedisTimeoutError | OSError):
                nodes[i].mark_down()
            elif nodes[i]._down_until:
                nodes[i]._down_until = 0.0  # it answered: its cool-down is over
    return replies


def _run_one(
    node: Node, name: str, keys: Sequence[str], args: Sequence[Any], timeout: float
) -> Reply:
    """:func:`run_script` on one plain node (not Sentinel-watched, not a Cluster): the same
    steps without the fan-out's bookkeeping, which costs more than the rest of a lock cycle's
    Python on a single Redis."""
    conn = node.connection()
    if conn._sock is None:
        try:
            connect(node, conn)
        except (RedisError, OSError) as exc:
            exc.dlock_unsent = True  # type: ignore[union-attr]
            return exc
    script = node.scripts[name]
    packed = _pack(conn, ("EVALSHA", script.sha, len(keys), *keys, *args))
    if timeout >= node.timeout:
        reply = _exchange_one(node, conn, packed)
    else:  # a shorter deadline than the socket timeout: poll for the reply
        replies: list[Reply] = [_PENDING]
        _exchange((node,), (conn,), (0,), packed, timeout, replies)
        reply = replies[0]
    if isinstance(reply, NoScriptError):
        replies = [reply]
        _send_source((node,), (conn,), (0,), script, keys, args, timeout, replies)
        reply = replies[0]
    return reply


def _exchange_one(node: Node, conn: Connection, packed: Any) -> Reply:
    """:func:`_exchange` for one plain node whose socket timeout bounds the wait: write
    ``packed``, read its reply (after any owed before it)."""
    tracked = _any_tracked
    unread = False
    try:
        if conn._dlock.owed:
            _drain(node, conn)
        try:
            _write(node, conn, packed, tracked)
        except (RedisError, OSError) as exc:
            return exc
        unread = True
        return _reply(node, conn) if tracked else _read(conn)
    except BaseException:  # interrupted: the reply must never be read as a later one's
        if unread:
            conn.disconnect()
        raise


def _ask_again(
    nodes: Sequence[Node],
    conns: Sequence[Connection],
    demoted: Sequence[int],
    packed: Any,
    timeout: float,
    replies: list[Reply],
) -> None:
    """Send ``packed`` once more to Sentinel nodes whose server said it is a replica now
    (``READONLY``), on connections opened afresh through the sentinels."""
    for i in demoted:
        log.warning(
            "%s: %s:%s is no longer the master (%s); asking the sentinels again",
            nodes[i].shown,
            conns[i].host,
            conns[i].port,
            replies[i],
        )
        conns[i].disconnect()
        replies[i] = _PENDING
    _connect_all(nodes, conns, replies, timeout)
    again = [i for i in demoted if replies[i] is _PENDING]
    if again:
        _exchange(nodes, conns, again, packed, timeout, replies)


def _send_source(
    nodes: Sequence[Node],
    conns: Sequence[Connection],
    todo: Sequence[int],
    script: Script,
    keys: Sequence[str],
    args: Sequence[Any],
    timeout: float,
    replies: list[Reply],
) -> None:
    """Send the script's source to the nodes in ``todo`` that answered ``NOSCRIPT``."""
    forgot = [i for i in todo if isinstance(replies[i], NoScriptError)]
    if forgot:
        log.info("script not cached on %d node(s); sending its source", len(forgot))
        packed = _pack(conns[forgot[0]], ("EVAL", script.script, len(keys), *keys, *args))
        _exchange(nodes, conns, forgot, packed, timeout, replies)


def send_script(
    nodes: Sequence[Node],
    name: str,
    keys: Sequence[str],
    args: Sequence[Any],
    resend: Resend | None = None,
) -> list[Node]:
    """Send script ``name`` to every node without waiting for the replies; the nodes it could
    not be sent to (cooling down, unreachable) are returned.

    For releases at the end of a task, where waiting for the reply would only delay the next
    task. Where the server allows it, the script goes out after ``CLIENT REPLY SKIP`` and as
    source (``EVAL``), so no reply comes and none can be an unnoticed ``NOSCRIPT``: the server
    writes nothing and we read nothing, which saves both sides a socket operation per release
    (see :func:`_send_unanswered`). Otherwise each connection remembers what it still owes a
    reply for; the reply is read (and a forgotten script sent again as source) before that
    connection's next command. Redis runs a connection's commands in order, so nothing sent
    later on this thread can overtake it.

    A connection the server has closed (idle ``timeout``, ``CLIENT KILL``, a restart, a
    Sentinel failover) is found by a zero-timeout ``poll()`` before the write and replaced. A
    close that races the write is learnt afterwards: with ``resend`` given, the command stays
    unconfirmed on its socket until a later reply on that same socket shows the server read
    it; if the socket dies first, ``resend`` goes out again ahead of that connection's next
    command, and if the thread does not use the connection again soon, the janitor sends it
    (see :func:`overdue`). No round trip is added while connections are healthy.

    ``resend`` is ``(script, keys, args, until)``: safe to run twice, moot after ``until``
    (monotonic).
    """
    packed: dict[bool | None, Any] = {}  # by "sent as SHA" (None: no reply): packed once
    if nodes and nodes[0].cluster:
        try:
            nodes = [nodes[0].route(keys[0])]
        except RedisError as exc:
            log.debug("could not send %s to %s: %s", name, nodes[0].shown, exc)
            return list(nodes)
    if len(nodes) == 1:
        return [] if _send_to(nodes[0], name, keys, args, resend, packed) else list(nodes)
    missed: list[Node] = []
    for node in nodes:
        if node.down or not _send_to(node, name, keys, args, resend, packed):
            missed.append(node)
    return missed


def _send_to(
    node: Node,
    name: str,
    keys: Sequence[str],
    args: Sequence[Any],
    resend: Resend | None,
    packed: dict[bool | None, Any],
) -> bool:
    """:func:`send_script` to one node; False if it could not be sent (connection dropped)."""
    conn = node.connection()
    try:
        _prepare(node, conn)
        if not _send_unanswered(node, conn, name, keys, args, packed):
            _send_owed(node, conn, _Owed(name, tuple(keys), tuple(args)), packed)
        if resend is not None:  # unconfirmed until a later reply on this socket
            _track(node, conn, resend)
    except (RedisError, OSError) as exc:
        conn.disconnect()
        log.debug("could not send %s to %s: %s", name, node.shown, exc)
        return False
    return True


#: What to send again if a reply-less command may have been lost with its connection: a
#: script that is safe to run twice, its keys and arguments, and when it stops mattering.
Resend = tuple[str, tuple[str, ...], tuple[Any, ...], float]
#: One unconfirmed command on a connection: what to send again, the socket it went out on,
#: and when it went out (monotonic).
_Sent = tuple[Resend, Any, float]

#: Seconds a reply-less command may stay unconfirmed (its thread not using that connection
#: again) before the janitor sends it once more on its own connection.
CONFIRM_GRACE = 1.0
#: Wakes the janitor (set by :mod:`celery_dlock.redis.janitor`, which imports this module).
sweeper: Callable[[], None] | None = None
#: Connections that have carried a tracked command, for the janitor to look at; each is
#: registered once, so the release path takes no lock.
_tracked: weakref.WeakSet[Connection] = weakref.WeakSet()
_tracked_lock = threading.Lock()
#: True once any connection of this process has carried a tracked command.
_any_tracked = False


def _track(node: Node, conn: Connection, resend: Resend) -> None:
    """Keep ``resend`` on ``conn`` until a reply read there confirms it (see :func:`_settle`)."""
    global _any_tracked
    state: ConnState = conn._dlock
    sent: list[_Sent] | None = state.sent
    if sent is None:
        sent = state.sent = []
        with _tracked_lock:
            _tracked.add(conn)
        _any_tracked = True
        if sweeper is not None:
            sweeper()
    sent.append((resend, conn._sock, time.monotonic()))


def overdue(now: float) -> list[tuple[Node, Resend]]:
    """For the janitor: commands unconfirmed for :data:`CONFIRM_GRACE`, taken off their
    connections (the janitor sends them again; the owning thread no longer does)."""
    with _tracked_lock:
        conns = list(_tracked)
    out: list[tuple[Node, Resend]] = []
    while orphans:
        orphan: tuple[Node, Resend] = orphans.pop()
        if orphan[1][3] > now:
            out.append(orphan)
    for conn in conns:
        state: ConnState = conn._dlock
        sent: list[_Sent] | None = state.sent
        while sent:
            try:
                entry = sent[0]
                if entry[2] + CONFIRM_GRACE > now:
                    break
                sent.remove(entry)  # the owner may clear the list meanwhile: then it is gone
            except (IndexError, ValueError):
                break
            if entry[0][3] > now:
                out.append((state.node, entry[0]))
    return out


def tracking() -> bool:
    """Whether any connection of this process has carried a tracked command."""
    return _any_tracked


def _after_fork() -> None:
    """The parent's connections and their unconfirmed commands are the parent's."""
    global _tracked, _tracked_lock, _any_tracked
    _tracked = weakref.WeakSet()
    _tracked_lock = threading.Lock()
    _any_tracked = False


os.register_at_fork(after_in_child=_after_fork)


def _settle(conn: Connection) -> None:
    """A reply was read on ``conn``: every tracked command sent before it arrived."""
    sent: list[_Sent] | None = conn._dlock.sent
    if sent:
        sent.clear()


def _prepare(node: Node, conn: Connection) -> None:
    """Make ``conn`` ready for a command: connected, owed replies read, not closed by the
    server (a zero-timeout poll, no round trip), and what may have been lost with an earlier
    socket sent again ahead of the command."""
    if not is_connected(conn):
        connect(node, conn)
    state: ConnState = conn._dlock
    if state.owed:
        _drain(node, conn)
    if _stale(conn) or (node.watched and node.switched(conn)):
        reconnect(node, conn)
    sent: list[_Sent] | None = state.sent
    if sent and sent[0][1] is not conn._sock:
        _resend_lost(node, conn)


def _resend_lost(node: Node, conn: Connection) -> None:
    """Send again, ahead of the next command, the tracked commands whose socket died before
    a reply on it confirmed them; their replies are read before the command's."""
    sent: list[_Sent] | None = conn._dlock.sent
    if not sent or sent[0][1] is conn._sock:
        return
    lost = [entry for entry in sent if entry[1] is not conn._sock]
    sent[:] = [entry for entry in sent if entry[1] is conn._sock]
    now = time.monotonic()
    for resend, _, _ in lost:
        name, keys, args, until = resend
        if until <= now:
            continue
        log.info(
            "%s: a reply-less %s may be lost with its connection; sending it again",
            node.shown,
            name,
        )
        _send_owed(node, conn, _Owed(name, keys, args, must=True))
        sent.append((resend, conn._sock, now))


#: ``CLIENT REPLY SKIP``, packed once: sent before a command whose reply nobody will read
#: (Redis 3.2+, Valkey).
_SKIP_REPLY = b"*3\r\n$6\r\nCLIENT\r\n$5\r\nREPLY\r\n$4\r\nSKIP\r\n"
_PROBE = "\0probe"  # the name of the owed entry that finds out whether _SKIP_REPLY works
#: The probe, packed once: ``EVAL "return 'dlock-skip-probe'" 0``. A script, because a lock
#: user may run scripts (and maybe nothing else, not even PING); its reply cannot be mistaken
#: for a release's integer.
_PROBE_COMMAND = b"*3\r\n$4\r\nEVAL\r\n$25\r\nreturn 'dlock-skip-probe'\r\n$1\r\n0\r\n"
_PROBE_REPLIES = (b"dlock-skip-probe", "dlock-skip-probe")


def _send_unanswered(
    node: Node,
    conn: Connection,
    name: str,
    keys: Sequence[str],
    args: Sequence[Any],
    packed: dict[bool | None, Any],
) -> bool:
    """Send ``name`` so that the server writes no reply; False where that is not possible.

    Not on a Redis Cluster shard, whose ``MOVED`` reply must be seen to reach the key, nor on
    a Sentinel node, whose ``READONLY`` reply (a master demoted by ``REPLICAOF``) must be seen
    to send the command again to the new master: a skipped refusal would be confirmed by the
    next reply on the connection and the key left there until its ttl. The first time on a
    connection the command goes out with a probe (a trivial script after it): an ACL user
    without ``CLIENT REPLY`` gets an error for it and every reply comes back, and the probe's
    reader then turns skipping off for that connection (see :func:`_read_probe`).
    """
    if node.owner is not None or node.watched:
        return False
    able = _skippable(conn)
    if able is False:
        return False
    command = packed.get(None)  # the reply-less form, packed once for every node
    if command is None:
        source = node.scripts[name].script
        script = _pack(conn, ("EVAL", source, len(keys), *keys, *args))
        command = packed[None] = _SKIP_REPLY + b"".join(script)
    if able is None:  # not yet known on this socket: ask, and read the answer later
        conn.send_packed_command([command + _PROBE_COMMAND], check_health=False)
        conn._dlock.on(conn._sock).skip = False  # until the probe's reply says otherwise
        _owed(conn).append(_Owed(_PROBE, (), ()))
    else:
        conn.send_packed_command([command], check_health=False)
    return True


def _skippable(conn: Connection) -> bool | None:
    """Whether this connection's server honours ``CLIENT REPLY SKIP``; None: not asked yet."""
    state: ConnState = conn._dlock
    sock = conn._sock
    if state.sock is not sock:  # a new socket: ask again
        state.on(sock)
    return state.skip


def _read_probe(conn: Connection) -> None:
    """Read what a probe sent by :func:`_send_unanswered` brought back: the probe's reply alone
    if the skip worked; else the refusal of ``CLIENT REPLY``, the command's own reply (or
    error), then the probe's."""
    worked = True
    for _ in range(3):
        try:
            reply = conn.read_response()
        except ResponseError:
            worked = False
            continue
        if reply in _PROBE_REPLIES:
            break
        worked = False
    conn._dlock.on(conn._sock).skip = worked
    if not worked:
        log.info("CLIENT REPLY SKIP is refused on this connection; releases await replies")


class Deferred:
    """A script call sent on this thread's connection to one node, its reply read later.

    Lets a caller overlap the round trip with its own work (enqueue-time mode sends the queued
    lock's acquisition, then lets Celery build the message, then reads the reply).
    """

    __slots__ = ("_conn", "_node", "_reply", "done")

    def __init__(self, node: Node, conn: Connection) -> None:
        self._node = node
        self._conn = conn
        self._reply: Reply = None
        self.done = False

    def settle(self, reply: Reply) -> None:
        self._reply = reply
        self.done = True

    def result(self) -> Reply:
        """The reply, or the exception that stands in for it; read now if it was not yet.

        The connection's socket timeout (the node timeout) bounds the read.
        """
        if not self.done:
            _drain(self._node, self._conn)
            if not self.done:  # the connection was dropped before our reply came
                self.settle(RedisConnectionError(f"connection to {self._node.shown} lost"))
        return self._reply


def send_deferred(node: Node, name: str, keys: Sequence[str], args: Sequence[Any]) -> Deferred:
    """Send script ``name`` to one (non-Cluster) node; the reply is read by ``result()``.

    Checks the connection first as a waited-for call does (a server-closed connection is
    replaced), so a failure here means the node really is unreachable.
    """
    conn = node.connection()
    deferred = Deferred(node, conn)
    try:
        _prepare(node, conn)
        _send_owed(node, conn, _Owed(name, tuple(keys), tuple(args), deferred))
    except (RedisError, OSError) as exc:
        conn.disconnect()
        deferred.settle(exc)
    return deferred


class _Owed:
    """A command sent on a connection whose reply has not been read yet."""

    __slots__ = ("args", "deferred", "keys", "must", "name")

    def __init__(
        self,
        name: str,
        keys: tuple[str, ...],
        args: tuple[Any, ...],
        deferred: Deferred | None = None,
        must: bool = False,
    ) -> None:
        self.name = name
        self.keys = keys
        self.args = args
        self.deferred = deferred  # where the reply goes; None: checked, then dropped
        self.must = must  # sent again (tracked on the connection): an error reply is logged


def _send_owed(
    node: Node, conn: Connection, owed: _Owed, packed: dict[bool | None, Any] | None = None
) -> None:
    # The first time on a connection, send the source: nobody may read this reply for a long
    # time (the process may even exit first), so a NOSCRIPT must not be possible.
    known = _known(conn)
    cached = owed.name in known
    command = packed.get(cached) if packed is not None else None
    if command is None:
        script = node.scripts[owed.name]
        head = ("EVALSHA", script.sha) if cached else ("EVAL", script.script)
        command = _pack(conn, (*head, len(owed.keys), *owed.keys, *owed.args))
        if packed is not None:
            packed[cached] = command
    conn.send_packed_command(command, check_health=False)
    known.add(owed.name)
    _owed(conn).append(owed)


def _pack(conn: Connection, command: tuple[Any, ...]) -> Any:
    """``command`` in the wire protocol, for ``send_packed_command``.

    hiredis packs str, bytes and numbers exactly as redis-py does; anything else, or no
    hiredis, goes through the connection's own serializer.
    """
    if _hiredis_pack is not None:
        try:
            return [_hiredis_pack(command)]  # a list: a bare bytes object would be iterated
        except TypeError:
            pass
    return conn.pack_command(*command)


def _known(conn: Connection) -> set[str]:
    """Scripts this connection's server has run since it connected: safe to send by SHA."""
    state: ConnState = conn._dlock
    sock = getattr(conn, "_sock", None)
    if state.sock is not sock:  # a new socket: maybe a restarted server
        state.on(sock)
    return state.known


def _owed(conn: Connection) -> list[_Owed]:
    owed: list[_Owed] = conn._dlock.owed
    return owed


def _drain(node: Node, conn: Connection, *, more: bool = False) -> bool:
    """Read the replies ``conn`` still owes (see :func:`send_script`); drop it on trouble.

    A deferred call's reply (an error reply included) goes to its :class:`Deferred`; a
    connection that fails, or a read that is interrupted, is dropped, and the deferred calls
    still waiting get the error as their reply.

    On a Sentinel node, a reply that says the server is a replica now (``READONLY``) confirms
    nothing: the server refused what was sent before it too. The connection is then dropped,
    so the tracked commands go again (:func:`_resend_lost`) to the master the sentinels name
    next; with ``more`` (a command's reply is still to come on it) the caller drops it after
    reading that reply. Returns True in that case.
    """
    owed = _owed(conn)
    if not owed:
        return False
    failure: BaseException | None = None
    refused = False
    try:
        if not is_connected(conn):
            failure = RedisConnectionError(f"connection to {node.shown} lost")
            return False
        while owed:
            entry = owed[0]
            reply = _read_owed(node, conn, entry)
            owed.pop(0)
            if node.watched and _demoted(reply):
                refused = True
            elif not refused:
                _settle(conn)  # a reply came: what was sent before it on this socket arrived
            if entry.deferred is not None:
                entry.deferred.settle(reply)
        if refused:
            log.warning(
                "%s: %s:%s is no longer the master; what it refused goes to the master the "
                "sentinels name next",
                node.shown,
                conn.host,
                conn.port,
            )
            if not more:
                conn.disconnect()
        return refused
    except (RedisError, OSError) as exc:
        log.debug("reply owed by %s lost: %s", node.shown, exc)
        failure = exc
        conn.disconnect()
    except BaseException as exc:  # interrupted mid-read: the next reply would be misread
        failure = RedisConnectionError(f"read from {node.shown} interrupted: {exc!r}")
        conn.disconnect()
        raise
    finally:
        if not is_connected(conn):
            for entry in owed:
                if entry.deferred is not None and not entry.deferred.done:
                    entry.deferred.settle(failure or RedisConnectionError("connection lost"))
            owed.clear()  # tracked commands among them are sent again (_resend_lost)
    return False


def _read_owed(node: Node, conn: Connection, entry: _Owed) -> Reply:
    """Read the reply ``entry`` is owed; raises when the connection can no longer be used."""
    if entry.name == _PROBE:
        _read_probe(conn)
        return None
    try:  # the reply is almost always there already; the socket timeout bounds it
        return conn.read_response()
    except NoScriptError:
        source = node.scripts[entry.name].script
        conn.send_command("EVAL", source, len(entry.keys), *entry.keys, *entry.args)
        return _read(conn) if entry.deferred is not None else conn.read_response()
    except AskError:  # a Cluster slot moved since the send (MOVED is an AskError)
        if node.owner is None:
            raise
        cluster = cast(Cluster, node.owner)
        cluster.reload_later()
        return cluster.run(entry.name, entry.keys, entry.args, node.timeout)
    except ResponseError as exc:
        if node.watched and _demoted(exc):
            return exc  # a replica now: _drain has it sent again elsewhere
        if entry.deferred is None and not entry.must:
            raise
        if entry.must:  # refused, not lost: sending it again cannot help
            log.warning("%s refused %s: %s", node.shown, entry.name, exc)
        return exc


def _exchange(
    nodes: Sequence[Node],
    conns: Sequence[Connection],
    todo: Sequence[int],
    packed: Any,
    timeout: float,
    replies: list[Reply],
) -> None:
    """Write ``packed`` to each connection in ``todo``, then read each reply by one deadline.

    With several nodes, one ``poll()`` over all their sockets both finds connections the
    server has closed (readable before we asked) and waits for replies in whatever order they
    come, instead of a readiness check per node.

    If anything interrupts us (a soft time limit, ``LockLost`` raised into the thread), every
    connection whose reply is still unread is dropped before the exception goes on, so that
    reply can never be read as the answer to a later command.
    """
    unread: dict[int, int] = {}  # socket fd -> node index
    # Connections that never carried a tracked command (reply-less releases) owe nothing to
    # send again or confirm: skip that bookkeeping on them (Redlock's waited calls, renewals).
    tracked = _any_tracked
    try:
        for i in todo:
            _drain(nodes[i], conns[i])
        stale = _stale_set(conns, todo) if len(todo) > 1 else None
        for i in todo:
            conn = conns[i]
            try:
                _write(nodes[i], conn, packed, tracked, (i in stale) if stale is not None else None)
                unread[conn._sock.fileno()] = i
            except (RedisError, OSError) as exc:
                replies[i] = exc
        if len(unread) == 1 and timeout >= nodes[next(iter(unread.values()))].timeout:
            # One node alone may simply block up to its socket timeout.
            i = unread.popitem()[1]
            replies[i] = _reply(nodes[i], conns[i]) if tracked else _read(conns[i])
            return
        deadline = time.monotonic() + timeout
        poller = select.poll()
        for fd in unread:
            poller.register(fd, select.POLLIN)
        while unread:
            left = deadline - time.monotonic()
            # Past the deadline, still a zero-timeout poll: a thread that got the CPU (or the
            # GIL) back late takes the replies already there rather than call those nodes silent.
            ready = poller.poll(max(left, 0.0) * 1000)
            if not ready:
                for i in unread.values():
                    conns[i].disconnect()
                    replies[i] = RedisTimeoutError(f"no answer within {timeout:g} s")
                unread.clear()
                break
            for fd, _ in ready:
                i = unread.pop(fd)
                poller.unregister(fd)
                replies[i] = _reply(nodes[i], conns[i]) if tracked else _read(conns[i])
    except BaseException:
        for i in unread.values():
            conns[i].disconnect()
        raise


def _write(
    node: Node, conn: Connection, packed: Any, tracked: bool, stale: bool | None = None
) -> None:
    """Write ``packed`` on ``conn``, whose owed replies are read: first reconnect it if the
    server closed it (``stale``; None: poll it now) or it reaches a master no longer
    announced, and, on a connection that has carried tracked commands, send again those lost
    with an earlier socket."""
    if (_stale(conn) if stale is None else stale) or (node.watched and node.switched(conn)):
        # Readable before we asked: the server closed the connection (restart, idle
        # timeout). Or the sentinels announced another master. Reconnect rather than fail.
        reconnect(node, conn)
    if tracked:
        sent = conn._dlock.sent
        if sent and sent[0][1] is not conn._sock:
            _resend_lost(node, conn)
    conn.send_packed_command(packed, check_health=False)


def _read(conn: Connection) -> Reply:
    """One reply, or the exception that stands in for it."""
    try:
        return conn.read_response()
    except (RedisError, OSError) as exc:
        return exc


def _reply(node: Node, conn: Connection) -> Reply:
    """The reply to the command just sent on ``conn`` (after any sent again ahead of it), or
    the exception that stands in for it. A reply read confirms the reply-less commands sent
    before it on this socket."""
    state: ConnState = conn._dlock
    refused = bool(state.owed) and _drain(node, conn, more=True)
    try:
        reply = conn.read_response()
    except ResponseError as exc:  # an error reply is still a reply
        if node.watched and _demoted(exc):
            # A replica now: it refused what was sent before, too. Drop the connection, so
            # that goes again (_resend_lost) to the master the sentinels name next.
            conn.disconnect()
            return exc
        reply = exc
    except (RedisError, OSError) as exc:
        return exc
    if refused:  # a replica refused what went before: nothing is confirmed (see _drain)
        conn.disconnect()
        return reply
    sent: list[_Sent] | None = state.sent
    if sent:
        sent.clear()  # confirmed (see _settle)
    return reply


def _stale_set(conns: Sequence[Connection], todo: Sequence[int]) -> set[int]:
    """Which of the connections have data or EOF waiting before we asked anything."""
    poller = select.poll()
    by_fd: dict[int, int] = {}
    for i in todo:
        sock = getattr(conns[i], "_sock", None)
        if sock is not None:
            by_fd[sock.fileno()] = i
            poller.register(sock, select.POLLIN)
    stale = {by_fd[fd] for fd, _ in poller.poll(0)}
    for i in by_fd.values():
        sock = conns[i]._sock
        if i not in stale and isinstance(sock, ssl.SSLSocket) and _tls_pending(sock):
            stale.add(i)
    return stale


def _tls_pending(sock: ssl.SSLSocket) -> bool:
    """True if the TLS layer holds decrypted bytes nobody has read (invisible to ``poll()``).

    Our reads take whole TLS records, so this is only ever true when something else read part
    of one; then an idle connection has data waiting, and is stale like one ``poll()`` flags.
    Replies to a command just sent need no such check: their bytes reach the socket, where
    ``poll()`` sees them, before anything reads them into the TLS layer.
    """
    try:
        return sock.pending() > 0
    except (OSError, ValueError):
        return True


def blocking_pop(node: Node, key: str, seconds: float) -> bytes | None:
    """BLPOP ``key`` for up to ``seconds`` on this thread's wait connection.

    Returns the popped element, or None when the wait ran out. Raises ``RedisError`` /
    ``OSError`` when the node cannot be used, so the caller can try another node. An
    interrupted wait drops its connection, or its BLPOP would go on to swallow a wake-up
    meant for another waiter.
    """
    node = node.route(key)
    conn = node.connection("wait")
    if is_connected(conn) and (_stale(conn) or (node.watched and node.switched(conn))):
        conn.disconnect()
    try:
        conn.send_command("BLPOP", key, f"{seconds:.3f}")
        # The server answers nil at its own timeout; allow it the node timeout on top.
        if not conn.can_read(seconds + node.timeout):
            raise RedisTimeoutError(f"BLPOP on {node.shown} did not answer")
        reply = conn.read_response()
    except BaseException as exc:
        conn.disconnect()
        if node.owner is not None and isinstance(exc, RedisError):
            cast(Cluster, node.owner).reload_later()  # MOVED, or a master gone: look again
        raise
    if not reply:
        return None
    popped: bytes = reply[1]
    return popped
