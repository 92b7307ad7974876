"""``CLIENT REPLY SKIP``: whether a connection's server honours it, and the probe that finds out.

A release nobody waits for goes out after ``CLIENT REPLY SKIP`` (:mod:`.sending`), so the
server writes no reply. An ACL user may not be allowed ``CLIENT REPLY``; the first such send on
a socket carries a probe after it, and the probe's reply, read as an owed reply
(:mod:`.owed`), says whether the skip worked. The answer is kept on the connection's
:class:`~.nodes.ConnState`, for its socket.
"""

from __future__ import annotations

import logging

from redis.exceptions import ResponseError

from celery_dlock.backends.redis.nodes import Connection, ConnState

#: The logger operators know for connection problems with one node (docs/operations.md).
log = logging.getLogger("celery_dlock.transport")

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
