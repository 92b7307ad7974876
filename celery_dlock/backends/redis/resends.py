"""Reply-less commands not yet confirmed, and sending them again if their socket died.

A release sent after ``CLIENT REPLY SKIP`` gets no reply, so nothing says it arrived. Each one
sent with a :data:`Resend` stays on its connection (``ConnState.sent``, with the socket it went
out on) until a later reply read on that same socket confirms it: Redis runs a connection's
commands in order, so a reply means everything before it was read. If that socket dies first,
:func:`resend_lost` sends it again ahead of the connection's next command; if the thread does
not use the connection again within :data:`CONFIRM_GRACE`, the janitor takes it
(:func:`overdue`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from celery_dlock.backends.redis.nodes import Connection, ConnState, Node, orphans
from celery_dlock.backends.redis.owed import Owed, send_owed

#: The logger operators know for connection problems with one node (docs/operations.md).
log = logging.getLogger("celery_dlock.transport")

#: What to send again if a reply-less command may have been lost with its connection: a
#: script that is safe to run twice, its keys and arguments, and when it stops mattering.
Resend = tuple[str, tuple[str, ...], tuple[Any, ...], float]
#: One unconfirmed command on a connection: what to send again, the socket it went out on,
#: and when it went out (monotonic).
Sent = tuple[Resend, Any, float]
#: Seconds a reply-less command may stay unconfirmed (its thread not using that connection
#: again) before the janitor sends it once more on its own connection.
CONFIRM_GRACE = 1.0
#: Wakes the janitor (set by :mod:`celery_dlock.backends.redis.janitor`, which imports this module).
sweeper: Callable[[], None] | None = None
#: Connections that have carried a tracked command, for the janitor to look at; each is
#: registered once, so the release path takes no lock.
_tracked: weakref.WeakSet[Connection] = weakref.WeakSet()
_tracked_lock = threading.Lock()
#: True once any connection of this process has carried a tracked command.
any_tracked = False


def track(node: Node, conn: Connection, resend: Resend) -> None:
    """Keep ``resend`` on ``conn`` until a reply read there confirms it (see
    :func:`.owed.drain`)."""
    global any_tracked
    state: ConnState = conn._dlock
    sent: list[Sent] | None = state.sent
    if sent is None:
        sent = state.sent = []
        with _tracked_lock:
            _tracked.add(conn)
        any_tracked = True
        if sweeper is not None:
            sweeper()
    sent.append((resend, conn._sock, time.monotonic()))


def resend_lost(node: Node, conn: Connection) -> None:
    """Send again, ahead of the next command, the tracked commands whose socket died before
    a reply on it confirmed them; their replies are read before the command's."""
    sent: list[Sent] | None = conn._dlock.sent
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
        send_owed(node, conn, Owed(name, keys, args, must=True))
        sent.append((resend, conn._sock, now))


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
        sent: list[Sent] | None = state.sent
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
    return any_tracked


def _after_fork() -> None:
    """The parent's connections and their unconfirmed commands are the parent's."""
    global _tracked, _tracked_lock, any_tracked
    _tracked = weakref.WeakSet()
    _tracked_lock = threading.Lock()
    any_tracked = False


os.register_at_fork(after_in_child=_after_fork)
