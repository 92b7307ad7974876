"""Connections made ready: several nodes connected in parallel, and whether an idle connection
is still good (the server may have closed it, or left bytes on it).

A connection is connected by :func:`.nodes.connect`; this module connects the connections a
fan-out call needs all at once (:func:`connect_all`), and tells with one ``poll()`` and no round
trip whether an idle one has data or EOF waiting (:func:`stale`, :func:`stale_set`): then it
can no longer be trusted and is replaced before the next command.

``poll()`` is ``select.poll``, or under eventlet (whose monkey patching removes ``select.poll``,
which it cannot make cooperative) the same interface over its cooperative ``select.select``
(:func:`poller`).
"""

from __future__ import annotations

import select
import ssl
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_dlock.backends.redis.nodes import (
    Connection,
    ConnState,
    Node,
    Reply,
    connect,
    is_connected,
)
from celery_dlock.core.background import ProcessPool
from celery_dlock.core.errors import ConfigError

#: ``select.POLLIN``: kept by eventlet's patching, but the constant is fixed by the platform.
POLLIN: int = getattr(select, "POLLIN", 1)

#: A node's reply not in yet: what a call's list of replies holds for the nodes still to do.
PENDING = object()


#: Opens several connections in parallel, so that nodes which accept TCP but never answer
#: delay a call by one timeout, not one per node. Only ever runs ``connect()``, never waits on
#: itself, so it cannot deadlock; its threads start on demand, and there are enough that one
#: caller's connects (the watchdog's) do not queue behind many others'.
_connector = ProcessPool("dlock-connect", 64)


def connect_all(
    nodes: Sequence[Node], conns: Sequence[Connection], replies: list[Reply], timeout: float
) -> None:
    """Connect every connection that is not, giving up after ``timeout``; a failure becomes
    that node's reply."""
    todo = [i for i, conn in enumerate(conns) if replies[i] is PENDING and not is_connected(conn)]
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
    begun = time.monotonic()
    futures: dict[int, Future[None]] = {}
    refusal: ConfigError | None = None
    try:
        for i in todo:
            futures[i] = _connector.submit(connect, nodes[i], conns[i])
        for i, future in futures.items():
            try:
                failure = future.exception(timeout=max(timeout - (time.monotonic() - begun), 0.0))
            except FutureTimeout:
                _give_up(nodes[i], conns[i], future)
                failure = RedisTimeoutError(f"connecting to {nodes[i].shown} took too long")
            if isinstance(failure, ConfigError):  # two nodes reach one server: refuse
                refusal = failure
            elif failure is not None:
                failure.dlock_unsent = True  # type: ignore[attr-defined]
                replies[i] = failure
    except BaseException:
        # Interrupted (a soft time limit, LockLost): the connects still running would go on
        # beside this thread's next command on the same connection (AUTH, SELECT unanswered).
        for i, future in futures.items():
            if not future.done():
                _give_up(nodes[i], conns[i], future)
        raise
    if refusal is not None:
        raise refusal


def _give_up(node: Node, conn: Connection, future: Future[None]) -> None:
    """Still connecting in the background: the thread never uses that connection object
    again, and it is closed once the connect ends, or its socket would stay open with nobody
    to close it."""
    future.add_done_callback(_closer(conn))
    node.drop_connection()


def _closer(conn: Connection) -> Callable[[Future[Any]], None]:
    """A callback that closes ``conn`` when a connect given up on finally ends."""
    return lambda _: conn.disconnect()


class SelectPoll:
    """``select.poll``'s interface over ``select.select``, for when an event library has taken
    ``select.poll`` away: eventlet's ``monkey_patch()`` removes it, and its ``select.select``
    waits in the hub instead, so other green threads run meanwhile. Only ``POLLIN``."""

    __slots__ = ("_fds",)

    def __init__(self) -> None:
        self._fds: list[int] = []

    def register(self, fd: Any, eventmask: int = POLLIN) -> None:
        number = fd if isinstance(fd, int) else fd.fileno()
        if number not in self._fds:
            self._fds.append(number)

    def unregister(self, fd: Any) -> None:
        self._fds.remove(fd if isinstance(fd, int) else fd.fileno())

    def poll(self, timeout: float | None = None) -> list[tuple[int, int]]:
        """``(fd, POLLIN)`` for each readable descriptor; ``timeout`` in milliseconds."""
        seconds = None if timeout is None or timeout < 0 else timeout / 1000
        if not self._fds:
            if seconds:
                time.sleep(seconds)
            return []
        readable, _, _ = select.select(self._fds, [], [], seconds)
        return [(fd, POLLIN) for fd in readable]


def poller() -> Any:
    """A new ``select.poll`` object, or a :class:`SelectPoll` where ``select.poll`` is gone.

    Looked up on each call, not at import: a process may be monkey-patched after importing
    this module.
    """
    make = getattr(select, "poll", None)
    return make() if make is not None else SelectPoll()


def stale(conn: Connection) -> bool:
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
        polled = state.poll
        if polled is None or state.sock is not sock:
            state.on(sock)
            polled = state.poll = poller()
            polled.register(sock, POLLIN)
            state.tls = isinstance(sock, ssl.SSLSocket)
        if state.tls and _tls_pending(sock):
            return True
        return bool(polled.poll(0))
    except (OSError, ValueError):
        return True


def stale_set(conns: Sequence[Connection], todo: Sequence[int]) -> set[int]:
    """Which of the connections have data or EOF waiting before we asked anything."""
    polled = poller()
    by_fd: dict[int, int] = {}
    for i in todo:
        sock = getattr(conns[i], "_sock", None)
        if sock is not None:
            by_fd[sock.fileno()] = i
            polled.register(sock, POLLIN)
    waiting = {by_fd[fd] for fd, _ in polled.poll(0)}
    for i in by_fd.values():
        sock = conns[i]._sock
        if i not in waiting and isinstance(sock, ssl.SSLSocket) and _tls_pending(sock):
            waiting.add(i)
    return waiting


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
