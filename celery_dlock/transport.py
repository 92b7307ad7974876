"""Talking to Redis nodes: one script sent to every node at once, replies gathered by a deadline.

Redlock's safety depends on contacting all masters within the validity window, so a call must
not visit nodes one after another. Instead of a thread per node (whose hand-offs and GIL
contention cost more than the round trip itself on a busy worker), each thread keeps one
connection per node, packs the command once, writes it to every socket, then reads the replies
against one shared deadline: N nodes cost one round trip plus N small writes and reads.

Connections are redis-py ``Connection`` objects built from the node's pool settings, so URL
options, TLS, authentication and the hiredis parser work as in redis-py. Scripts are redis-py
``Script`` objects registered on each node's client; their SHA is what we send.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_dlock import scripts
from celery_dlock.config import redact

log = logging.getLogger("celery_dlock.transport")

#: A node's answer: the script's reply, or the exception that stood in for it.
Reply = Any
#: A redis-py ``Connection``; typed loosely because redis-py leaves most of its methods untyped.
Connection = Any


class Node:
    """One Redis master: a redis-py client, its scripts, and one connection per thread."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.shown = redact(url)
        self.timeout = timeout
        self.client: redis.Redis = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        self.scripts: dict[str, Script] = {
            name: self.client.register_script(source) for name, source in scripts.ALL.items()
        }
        self._local = threading.local()
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"<Node {self.shown}>"

    def _new_connection(self) -> Connection:
        pool = self.client.connection_pool
        conn: Connection = pool.connection_class(**pool.connection_kwargs)
        return conn

    def connection(self, purpose: str = "cmd") -> Connection:
        """This thread's connection for ``purpose`` ("cmd", or "wait" for blocking pops)."""
        if self._pid != os.getpid():
            # A forked child must not share the parent's sockets: start afresh.
            self._local = threading.local()
            self._pid = os.getpid()
        conns: _ThreadConnections | None = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = _ThreadConnections()
        conn = conns.get(purpose)
        if conn is None:
            conn = conns[purpose] = self._new_connection()
        return conn

    def close(self) -> None:
        """Close this thread's connections and the client's pool."""
        conns: _ThreadConnections | None = getattr(self._local, "conns", None)
        if conns is not None:
            conns.close()
        self.client.close()


class _ThreadConnections(dict[str, Connection]):
    """One thread's connections to one node, closed when the thread ends.

    A thread's ``threading.local`` data is dropped by reference counting when the thread
    exits, so ``__del__`` runs then; redis-py connections themselves sit in reference cycles
    and would otherwise wait for the cycle collector, leaking their sockets until it runs.
    """

    def close(self) -> None:
        for conn in self.values():
            conn.disconnect()
        self.clear()

    def __del__(self) -> None:
        self.close()


def is_connected(conn: Connection) -> bool:
    return getattr(conn, "_sock", None) is not None


class _Connector:
    """A small persistent thread pool that opens several connections in parallel.

    Only used when two or more nodes need a new connection at once (first use, or after
    failures), so that a node that accepts TCP but never answers delays the call by one
    timeout, not one per node. Recreated after fork.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dlock-connect")
                self._pid = os.getpid()
            return self._pool


_connector = _Connector()


def background(fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` on the connector pool, not waiting for it (best-effort cleanup)."""
    _connector.get().submit(fn, *args)


def _connect_all(conns: Sequence[Connection], replies: list[Reply]) -> None:
    """Connect every connection that is not; a failure becomes that node's reply."""
    todo = [i for i, conn in enumerate(conns) if not is_connected(conn)]
    if not todo:
        return
    if len(todo) == 1:
        i = todo[0]
        try:
            conns[i].connect()
        except (RedisError, OSError) as exc:
            replies[i] = exc
        return
    pool = _connector.get()
    futures = {i: pool.submit(conns[i].connect) for i in todo}
    for i, future in futures.items():
        failure = future.exception()
        if failure is not None:
            replies[i] = failure


_PENDING = object()


def _stale(conn: Connection) -> bool:
    """True if an idle connection has data or EOF waiting: it can no longer be trusted."""
    try:
        return bool(conn.can_read(0))
    except (RedisError, OSError):
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
    conns = [node.connection() for node in nodes]
    replies: list[Reply] = [_PENDING] * len(nodes)
    _connect_all(conns, replies)
    todo = [i for i, reply in enumerate(replies) if reply is _PENDING]
    if not todo:
        return replies
    script = nodes[0].scripts[name]
    packed = conns[todo[0]].pack_command("EVALSHA", script.sha, len(keys), *keys, *args)
    _exchange(nodes, conns, todo, packed, timeout, replies)
    forgot = [i for i in todo if isinstance(replies[i], NoScriptError)]
    if forgot:
        log.info("script %s not cached on %d node(s); sending its source", name, len(forgot))
        packed = conns[forgot[0]].pack_command("EVAL", script.script, len(keys), *keys, *args)
        _exchange(nodes, conns, forgot, packed, timeout, replies)
    return replies


def _exchange(
    nodes: Sequence[Node],
    conns: Sequence[Connection],
    todo: Sequence[int],
    packed: Any,
    timeout: float,
    replies: list[Reply],
) -> None:
    """Write ``packed`` to each connection in ``todo``, then read each reply by one deadline."""
    sent: list[int] = []
    for i in todo:
        conn = conns[i]
        try:
            if _stale(conn):
                # Readable before we asked: the server closed the connection (restart,
                # idle timeout). Reconnect rather than fail this call.
                conn.disconnect()
                conn.connect()
            conn.send_packed_command(packed, check_health=False)
            sent.append(i)
        except (RedisError, OSError) as exc:
            replies[i] = exc
    deadline = time.monotonic() + timeout
    for i in sent:
        conn = conns[i]
        try:
            # One node alone may simply block up to its socket timeout; with several, a slow
            # one must not eat into the time left for the others.
            if (len(nodes) > 1 or timeout < nodes[i].timeout) and not conn.can_read(
                max(deadline - time.monotonic(), 0.0)
            ):
                conn.disconnect()
                raise RedisTimeoutError(f"no answer within {timeout:g} s")
            replies[i] = conn.read_response()
        except (RedisError, OSError) as exc:
            replies[i] = exc


def blocking_pop(node: Node, key: str, seconds: float) -> bool:
    """BLPOP ``key`` for up to ``seconds`` on this thread's wait connection; True if popped.

    Raises ``RedisError`` / ``OSError`` when the node cannot be used, so the caller can try
    another node.
    """
    conn = node.connection("wait")
    if is_connected(conn) and _stale(conn):
        conn.disconnect()
    conn.send_command("BLPOP", key, f"{seconds:.3f}")
    # The server answers nil at its own timeout; allow it the node timeout on top.
    if not conn.can_read(seconds + node.timeout):
        conn.disconnect()
        raise RedisTimeoutError(f"BLPOP on {node.shown} did not answer")
    return conn.read_response() is not None
