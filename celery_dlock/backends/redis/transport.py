"""Talking to Redis nodes: one script sent to every node at once, replies gathered by a deadline.

Redlock's safety depends on contacting all masters within the validity window, so a call must
not visit nodes one after another. Instead of a thread per node (whose hand-offs and GIL
contention cost more than the round trip itself on a busy worker), each thread keeps one
connection per node, packs the command once, writes it to every socket, then reads the replies
against one shared deadline: N nodes cost one round trip plus N small writes and reads.

Connections are redis-py ``Connection`` objects built from the node's pool settings, so URL
options, TLS, authentication and the hiredis parser work as in redis-py. Scripts are redis-py
``Script`` objects registered on each node's client; their SHA is what we send.

This module is the fan-out (:func:`run_script`) and the one-node exchange (one plain node,
:func:`blocking_pop`). Below it: :mod:`.connecting` (connects, stale connections),
:mod:`.owed` (packing, reading, replies still owed, read before the next command),
:mod:`.resends` (reply-less releases not yet confirmed); beside it, :mod:`.sending` (scripts
sent without waiting). The nodes and their connections are :mod:`celery_dlock.backends.redis.nodes`;
a Redis Cluster (:mod:`celery_dlock.backends.redis.cluster`) routes each call to one of its masters,
then uses this module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, cast

from redis.commands.core import Script
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_dlock.backends.redis import resends
from celery_dlock.backends.redis.connecting import (
    PENDING,
    POLLIN,
    connect_all,
    poller,
    stale,
    stale_set,
)
from celery_dlock.backends.redis.nodes import (
    Cluster,
    Connection,
    ConnState,
    MasterSwitched,
    Node,
    Reply,
    connect,
    reconnect,
)
from celery_dlock.backends.redis.owed import demoted, drain, pack, read
from celery_dlock.backends.redis.resends import Sent, resend_lost
from celery_dlock.backends.redis.sending import prepare

#: The logger operators know for connection problems with one node (docs/operations.md).
log = logging.getLogger("celery_dlock.transport")


class CoolingDown(RedisConnectionError):
    """A node skipped during its cool-down: nothing was sent to it."""

    dlock_unsent = True


def unsent(reply: Reply) -> bool:
    """True for a failure that happened before anything was sent (cool-down, no connection):
    that node cannot run the command late."""
    return bool(getattr(reply, "dlock_unsent", False))


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
        if node.cluster:  # a Cluster is always the only node (urls.check_urls)
            return [cast(Cluster, node).run(name, keys, args, timeout)]
        if not node.watched:
            return [_run_one(node, name, keys, args, timeout)]
    conns = [node.connection() for node in nodes]
    replies: list[Reply] = [PENDING] * len(nodes)
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
    connect_all(nodes, conns, replies, timeout)
    todo = [i for i, reply in enumerate(replies) if reply is PENDING]
    if not todo:
        return replies
    script = nodes[0].scripts[name]
    packed = pack(conns[todo[0]], ("EVALSHA", script.sha, len(keys), *keys, *args))
    _exchange(nodes, conns, todo, packed, timeout, replies)
    _send_source(nodes, conns, todo, script, keys, args, timeout, replies)
    replicas = [i for i in todo if nodes[i].watched and demoted(replies[i])]
    if replicas:
        _ask_again(nodes, conns, replicas, packed, timeout, replies)
        _send_source(nodes, conns, replicas, script, keys, args, timeout, replies)
        for i in replicas:
            if demoted(replies[i]):  # the sentinels still name a replica: nothing was done
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
    packed = pack(conn, ("EVALSHA", script.sha, len(keys), *keys, *args))
    if timeout >= node.timeout:
        reply = _exchange_one(node, conn, packed)
    else:  # a shorter deadline than the socket timeout: poll for the reply
        replies: list[Reply] = [PENDING]
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
    tracked = resends.any_tracked
    unread = False
    try:
        if conn._dlock.owed:
            drain(node, conn)
        try:
            _write(node, conn, packed, tracked)
        except (RedisError, OSError) as exc:
            return exc
        unread = True
        return _reply(node, conn) if tracked else read(conn)
    except BaseException:  # interrupted: the reply must never be read as a later one's
        if unread:
            conn.disconnect()
        raise


def _ask_again(
    nodes: Sequence[Node],
    conns: Sequence[Connection],
    replicas: Sequence[int],
    packed: Any,
    timeout: float,
    replies: list[Reply],
) -> None:
    """Send ``packed`` once more to Sentinel nodes whose server said it is a replica now
    (``READONLY``), on connections opened afresh through the sentinels."""
    for i in replicas:
        log.warning(
            "%s: %s:%s is no longer the master (%s); asking the sentinels again",
            nodes[i].shown,
            conns[i].host,
            conns[i].port,
            replies[i],
        )
        conns[i].disconnect()
        replies[i] = PENDING
    connect_all(nodes, conns, replies, timeout)
    again = [i for i in replicas if replies[i] is PENDING]
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
        packed = pack(conns[forgot[0]], ("EVAL", script.script, len(keys), *keys, *args))
        _exchange(nodes, conns, forgot, packed, timeout, replies)


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
    tracked = resends.any_tracked
    try:
        for i in todo:
            drain(nodes[i], conns[i])
        waiting = stale_set(conns, todo) if len(todo) > 1 else None
        for i in todo:
            conn = conns[i]
            try:
                _write(nodes[i], conn, packed, tracked, None if waiting is None else i in waiting)
                unread[conn._sock.fileno()] = i
            except (RedisError, OSError) as exc:
                replies[i] = exc
        if len(unread) == 1 and timeout >= nodes[next(iter(unread.values()))].timeout:
            # One node alone may simply block up to its socket timeout.
            i = unread.popitem()[1]
            replies[i] = _reply(nodes[i], conns[i]) if tracked else read(conns[i])
            return
        deadline = time.monotonic() + timeout
        polled = poller()
        for fd in unread:
            polled.register(fd, POLLIN)
        while unread:
            left = deadline - time.monotonic()
            # Past the deadline, still a zero-timeout poll: a thread that got the CPU (or the
            # GIL) back late takes the replies already there rather than call those nodes silent.
            ready = polled.poll(max(left, 0.0) * 1000)
            if not ready:
                for i in unread.values():
                    conns[i].disconnect()
                    replies[i] = RedisTimeoutError(f"no answer within {timeout:g} s")
                unread.clear()
                break
            for fd, _ in ready:
                i = unread.pop(fd)
                polled.unregister(fd)
                replies[i] = _reply(nodes[i], conns[i]) if tracked else read(conns[i])
    except BaseException:
        for i in unread.values():
            conns[i].disconnect()
        raise


def _write(
    node: Node, conn: Connection, packed: Any, tracked: bool, waiting: bool | None = None
) -> None:
    """Write ``packed`` on ``conn``, whose owed replies are read: first reconnect it if the
    server closed it (``waiting``: data or EOF was waiting on it; None: poll it now) or it
    reaches a master no longer announced, and, on a connection that has carried tracked
    commands, send again those lost with an earlier socket."""
    if (stale(conn) if waiting is None else waiting) or (node.watched and node.switched(conn)):
        # Readable before we asked: the server closed the connection (restart, idle
        # timeout). Or the sentinels announced another master. Reconnect rather than fail.
        reconnect(node, conn)
    if tracked:
        sent = conn._dlock.sent
        if sent and sent[0][1] is not conn._sock:
            resend_lost(node, conn)
    conn.send_packed_command(packed, check_health=False)


def _reply(node: Node, conn: Connection) -> Reply:
    """The reply to the command just sent on ``conn`` (after any sent again ahead of it), or
    the exception that stands in for it. A reply read confirms the reply-less commands sent
    before it on this socket."""
    state: ConnState = conn._dlock
    refused = bool(state.owed) and drain(node, conn, more=True)
    try:
        reply = conn.read_response()
    except ResponseError as exc:  # an error reply is still a reply
        if node.watched and demoted(exc):
            # A replica now: it refused what was sent before, too. Drop the connection, so
            # that goes again (resend_lost) to the master the sentinels name next.
            conn.disconnect()
            return exc
        reply = exc
    except (RedisError, OSError) as exc:
        return exc
    if refused:  # a replica refused what went before: nothing is confirmed (see drain)
        conn.disconnect()
        return reply
    sent: list[Sent] | None = state.sent
    if sent:
        sent.clear()  # confirmed (see owed._confirm_sent)
    return reply


def blocking_pop(node: Node, key: str, seconds: float) -> bytes | None:
    """BLPOP ``key`` for up to ``seconds`` on this thread's connection to the node.

    Returns the popped element, or None when the wait ran out. Raises ``RedisError`` /
    ``OSError`` when the node cannot be used, so the caller can try another node. An
    interrupted wait drops its connection, or its BLPOP would go on to swallow a wake-up
    meant for another waiter.

    The thread's command connection, made ready first as for any command (replies it still
    owes read, a server-closed socket replaced): a waiting thread sends nothing else
    meanwhile, so a second connection per waiter would only cost the server a client.
    """
    node = node.route(key)
    conn = node.connection()
    try:
        prepare(node, conn)
    except BaseException:
        conn.disconnect()
        raise
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


def time_left(node: Node, key: str) -> int:
    """``PTTL key`` on this thread's connection to the node: ms left, -1 without an expiry,
    -2 when missing. A waiter's look between two blocks (one command, not the acquire script).

    Raises ``RedisError`` / ``OSError`` when the node cannot answer within its timeout.
    """
    node = node.route(key)
    conn = node.connection()
    try:
        prepare(node, conn)
        conn.send_command("PTTL", key)
        if not conn.can_read(node.timeout):
            raise RedisTimeoutError(f"PTTL on {node.shown} did not answer")
        reply = conn.read_response()
    except BaseException as exc:
        conn.disconnect()
        if node.owner is not None and isinstance(exc, RedisError):
            cast(Cluster, node.owner).reload_later()
        raise
    return int(reply)
