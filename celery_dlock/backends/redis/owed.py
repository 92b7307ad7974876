"""One connection's commands: packed for the wire, replies read, and the replies it still owes.

**A command and its reply** (:func:`pack`, :func:`read`, :func:`demoted`): the lowest layer of
the Redis transport; every other module that writes to a connection packs and reads through
these.

**Owed replies**: commands sent without waiting, read before the connection's next one. A
command sent without waiting (:mod:`.sending`) is an :class:`Owed` entry on its connection's
:class:`~.nodes.ConnState`. Redis answers a connection's commands in order, so before anything
else is written there, :func:`drain` reads those replies: a :class:`Deferred` caller's reply
goes to it, a forgotten script is sent again as source, and a connection that fails on the way
is dropped, with the error as the reply of everyone still waiting on it.

**``CLIENT REPLY SKIP``** (:func:`skippable`, :func:`read_probe`): a release nobody waits for
goes out after ``CLIENT REPLY SKIP`` (:mod:`.sending`), so the server writes no reply. An ACL
user may not be allowed ``CLIENT REPLY``; the first such send on a socket carries a probe after
it, and the probe's reply, read as an owed reply, says whether the skip worked. The answer is
kept on the connection's :class:`~.nodes.ConnState`, for its socket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

from redis.exceptions import AskError, NoScriptError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from celery_dlock.backends.redis.nodes import (
    Cluster,
    Connection,
    ConnState,
    Node,
    Reply,
    is_connected,
)

#: The logger operators know for connection problems with one node (docs/operations.md).
log = logging.getLogger("celery_dlock.transport")

# -- one command on one connection: packed, its reply read ------------------------------------

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:  # redis-py's own serializer wraps this C packer in Python that costs more than it does
    import hiredis

    _hiredis_pack = hiredis.pack_command
except ImportError:  # pragma: no cover - hiredis is optional (the "fast" extra)
    _hiredis_pack = None


def pack(conn: Connection, command: tuple[Any, ...]) -> Any:
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


def read(conn: Connection) -> Reply:
    """One reply, or the exception that stands in for it."""
    try:
        return conn.read_response()
    except (RedisError, OSError) as exc:
        return exc


def demoted(reply: Reply) -> bool:
    """True for a reply that says the server is no longer a master: redis-py's own conversion
    of ``READONLY`` (Redis 7) or the ``ResponseError`` a script gets on Redis 6.2."""
    if isinstance(reply, ResponseError):
        return "READONLY" in str(reply)
    return isinstance(reply, RedisConnectionError) and "now a slave" in str(reply)


# -- CLIENT REPLY SKIP: whether a connection's server honours it, and the probe --------------

#: ``CLIENT REPLY SKIP``, packed once: sent before a command whose reply nobody will read
#: (Redis 3.2+, Valkey).
SKIP_REPLY = b"*3\r\n$6\r\nCLIENT\r\n$5\r\nREPLY\r\n$4\r\nSKIP\r\n"
PROBE = "\0probe"  # the name of the owed entry that finds out whether SKIP_REPLY works
#: The probe, packed once: ``EVAL "return 'dlock-skip-probe'" 0``. A script, because a lock
#: user may run scripts (and maybe nothing else, not even PING); its reply cannot be mistaken
#: for a release's integer.
PROBE_COMMAND = b"*3\r\n$4\r\nEVAL\r\n$25\r\nreturn 'dlock-skip-probe'\r\n$1\r\n0\r\n"
_PROBE_REPLIES = (b"dlock-skip-probe", "dlock-skip-probe")


def skippable(conn: Connection) -> bool | None:
    """Whether this connection's server honours ``CLIENT REPLY SKIP``; None: not asked yet."""
    state: ConnState = conn._dlock
    sock = conn._sock
    if state.sock is not sock:  # a new socket: ask again
        state.on(sock)
    return state.skip


def read_probe(conn: Connection) -> None:
    """Read what a probe sent with a reply-less release (:mod:`.sending`) brought back: the
    probe's reply alone if the skip worked; else the refusal of ``CLIENT REPLY``, the
    command's own reply (or error), then the probe's."""
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


# -- the replies a connection still owes ------------------------------------------------------


class Owed:
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

    def set_result(self, reply: Reply) -> None:
        """Store the reply (or the exception standing in for it), as ``Future.set_result``."""
        self._reply = reply
        self.done = True

    def result(self) -> Reply:
        """The reply, or the exception that stands in for it; read now if it was not yet.

        The connection's socket timeout (the node timeout) bounds the read.
        """
        if not self.done:
            drain(self._node, self._conn)
            if not self.done:  # the connection was dropped before our reply came
                self.set_result(RedisConnectionError(f"connection to {self._node.shown} lost"))
        return self._reply


def send_owed(
    node: Node, conn: Connection, owed: Owed, packed: dict[bool | None, Any] | None = None
) -> None:
    """Send ``owed``'s script on ``conn``, its reply to be read before the next command;
    ``packed`` keeps the packed command by "sent as SHA", for the next node of one call."""
    # The first time on a connection, send the source: nobody may read this reply for a long
    # time (the process may even exit first), so a NOSCRIPT must not be possible.
    known = _known(conn)
    cached = owed.name in known
    command = packed.get(cached) if packed is not None else None
    if command is None:
        script = node.scripts[owed.name]
        head = ("EVALSHA", script.sha) if cached else ("EVAL", script.script)
        command = pack(conn, (*head, len(owed.keys), *owed.keys, *owed.args))
        if packed is not None:
            packed[cached] = command
    conn.send_packed_command(command, check_health=False)
    known.add(owed.name)
    entries(conn).append(owed)


def _known(conn: Connection) -> set[str]:
    """Scripts this connection's server has run since it connected: safe to send by SHA."""
    state: ConnState = conn._dlock
    sock = getattr(conn, "_sock", None)
    if state.sock is not sock:  # a new socket: maybe a restarted server
        state.on(sock)
    return state.known


def entries(conn: Connection) -> list[Owed]:
    """The commands sent on ``conn`` whose replies are still to be read, in order."""
    owed: list[Owed] = conn._dlock.owed
    return owed


def drain(node: Node, conn: Connection, *, more: bool = False) -> bool:
    """Read the replies ``conn`` still owes (see :func:`.sending.send_script`); drop it on
    trouble.

    A deferred call's reply (an error reply included) goes to its :class:`Deferred`; a
    connection that fails, or a read that is interrupted, is dropped, and the deferred calls
    still waiting get the error as their reply.

    On a Sentinel node, a reply that says the server is a replica now (``READONLY``) confirms
    nothing: the server refused what was sent before it too. The connection is then dropped,
    so the tracked commands go again (:func:`.resends.resend_lost`) to the master the sentinels name
    next; with ``more`` (a command's reply is still to come on it) the caller drops it after
    reading that reply. Returns True in that case.
    """
    owed = entries(conn)
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
            if node.watched and demoted(reply):
                refused = True
            elif not refused:
                _confirm_sent(conn)  # a reply came: what was sent before it on this socket arrived
            if entry.deferred is not None:
                entry.deferred.set_result(reply)
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
                    entry.deferred.set_result(failure or RedisConnectionError("connection lost"))
            owed.clear()  # tracked commands among them are sent again (resend_lost)
    return False


def _confirm_sent(conn: Connection) -> None:
    """A reply was read on ``conn``: every tracked command sent before it arrived
    (:mod:`.resends`)."""
    sent = conn._dlock.sent
    if sent:
        sent.clear()


def _read_owed(node: Node, conn: Connection, entry: Owed) -> Reply:
    """Read the reply ``entry`` is owed; raises when the connection can no longer be used."""
    if entry.name == PROBE:
        read_probe(conn)
        return None
    try:  # the reply is almost always there already; the socket timeout bounds it
        return conn.read_response()
    except NoScriptError:
        source = node.scripts[entry.name].script
        conn.send_command("EVAL", source, len(entry.keys), *entry.keys, *entry.args)
        return read(conn) if entry.deferred is not None else conn.read_response()
    except AskError:  # a Cluster slot moved since the send (MOVED is an AskError)
        if node.owner is None:
            raise
        cluster = cast(Cluster, node.owner)
        cluster.reload_later()
        return cluster.run(entry.name, entry.keys, entry.args, node.timeout)
    except ResponseError as exc:
        if node.watched and demoted(exc):
            return exc  # a replica now: drain has it sent again elsewhere
        if entry.deferred is None and not entry.must:
            raise
        if entry.must:  # refused, not lost: sending it again cannot help
            log.warning("%s refused %s: %s", node.shown, entry.name, exc)
        return exc
