"""Sending a script without waiting for its reply: releases (:func:`send_script`) and calls whose
reply is read later (:func:`send_deferred`).

The connection is made ready first (:func:`prepare`: connected, owed replies read, a
server-closed socket replaced, lost releases sent again), so a failure here means the node
really is unreachable. The reply then is owed, or never written at all (``CLIENT REPLY
SKIP``; both in :mod:`.owed`), and a reply-less release is tracked until confirmed
(:mod:`.resends`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from celery_dlock.backends.redis.connecting import stale
from celery_dlock.backends.redis.nodes import (
    Connection,
    ConnState,
    Node,
    connect,
    is_connected,
    reconnect,
)
from celery_dlock.backends.redis.owed import (
    PROBE,
    PROBE_COMMAND,
    SKIP_REPLY,
    Deferred,
    Owed,
    drain,
    entries,
    pack,
    send_owed,
    skippable,
)
from celery_dlock.backends.redis.resends import Resend, Sent, resend_lost, track

#: The logger operators know for connection problems with one node (docs/operations.md).
log = logging.getLogger("celery_dlock.transport")


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
    (see :func:`.resends.overdue`). No round trip is added while connections are healthy.

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
        prepare(node, conn)
        if not _send_unanswered(node, conn, name, keys, args, packed):
            send_owed(node, conn, Owed(name, tuple(keys), tuple(args)), packed)
        if resend is not None:  # unconfirmed until a later reply on this socket
            track(node, conn, resend)
    except (RedisError, OSError) as exc:
        conn.disconnect()
        log.debug("could not send %s to %s: %s", name, node.shown, exc)
        return False
    return True


def send_deferred(node: Node, name: str, keys: Sequence[str], args: Sequence[Any]) -> Deferred:
    """Send script ``name`` to one (non-Cluster) node; the reply is read by ``result()``.

    Checks the connection first as a waited-for call does (a server-closed connection is
    replaced), so a failure here means the node really is unreachable.
    """
    conn = node.connection()
    deferred = Deferred(node, conn)
    try:
        prepare(node, conn)
        send_owed(node, conn, Owed(name, tuple(keys), tuple(args), deferred))
    except (RedisError, OSError) as exc:
        conn.disconnect()
        deferred.set_result(exc)
    return deferred


def prepare(node: Node, conn: Connection) -> None:
    """Make ``conn`` ready for a command: connected, owed replies read, not closed by the
    server (a zero-timeout poll, no round trip), and what may have been lost with an earlier
    socket sent again ahead of the command."""
    if not is_connected(conn):
        connect(node, conn)
    state: ConnState = conn._dlock
    if state.owed:
        drain(node, conn)
    if stale(conn) or (node.watched and node.switched(conn)):
        reconnect(node, conn)
    sent: list[Sent] | None = state.sent
    if sent and sent[0][1] is not conn._sock:
        resend_lost(node, conn)


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
    reader then turns skipping off for that connection (see :func:`.owed.read_probe`).
    """
    if node.owner is not None or node.watched:
        return False
    able = skippable(conn)
    if able is False:
        return False
    command = packed.get(None)  # the reply-less form, packed once for every node
    if command is None:
        source = node.scripts[name].script
        script = pack(conn, ("EVAL", source, len(keys), *keys, *args))
        command = packed[None] = SKIP_REPLY + b"".join(script)
    if able is None:  # not yet known on this socket: ask, and read the answer later
        conn.send_packed_command([command + PROBE_COMMAND], check_health=False)
        conn._dlock.on(conn._sock).skip = False  # until the probe's reply says otherwise
        entries(conn).append(Owed(PROBE, (), ()))
    else:
        conn.send_packed_command([command], check_health=False)
    return True
