"""Ctrl-C and SIGTERM in the demo: a signal asks it to stop, and it stops at its next check.

The handler only records the signal; the demo calls :func:`check` where stopping is clean
(before it starts a process, in every wait, between steps) and then unwinds its ExitStack,
which stops every process it started (a second signal changes nothing: each process gets at
most 10 s of warm shutdown before its group is SIGKILLed). A KeyboardInterrupt raised by
Python's default handler would land at any bytecode instead: inside ``Popen`` after the fork (a
child nobody stops), inside a worker's ``stop`` (its pool left running), or inside an import's
``exec`` of generated code (dataclasses, namedtuple, a Celery task's header). CPython 3.11
records a KeyboardInterrupt leaving code run by ``exec``/``eval`` of a string as *unhandled*
even once it is caught, and ``python -m`` then ends by killing itself with SIGINT (status -2)
after the demo returned 130.

``__main__`` installs the handler before its imports, so no moment of the demo is left to
Python's default one. For tests, ``EXAMPLE_DEMO_PAUSE_AT=<point>`` makes the demo print
``paused at <point>`` on stderr when it reaches that point and wait there until a stop signal
comes (at most :data:`PAUSE_LIMIT` seconds); the points are ``start`` (before the imports),
``redis`` (embedded servers just started), ``spawn <name>`` (process ``<name>`` just spawned)
and ``stop <name>`` (the demo begins to stop it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
PAUSE_LIMIT = 60.0  # seconds a pause point waits for the signal before going on
_received: list[int] = []  # the stop signals received, in order


class Interrupted(KeyboardInterrupt):
    """Raised by :func:`check` once SIGINT or SIGTERM has asked the demo to stop."""


def _record(signum: int, frame: object) -> None:
    _received.append(signum)


def install() -> None:
    """From now on SIGINT and SIGTERM only ask the demo to stop."""
    for signum in SIGNALS:
        signal.signal(signum, _record)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """:func:`install` for the block, then put back the handlers it found."""
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    install()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def requested() -> int | None:
    """The first stop signal received, or None."""
    return _received[0] if _received else None


def check() -> None:
    """Raise :class:`Interrupted` if a stop signal has come."""
    if _received:
        raise Interrupted(f"stopped by {signal.Signals(_received[0]).name}")


def sleep(seconds: float, step: float = 0.05) -> None:
    """``time.sleep(seconds)`` that returns early, by :class:`Interrupted`, on a stop signal."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        check()
        time.sleep(min(step, left))
    check()


def pause_point(name: str) -> None:
    """Test hook: at the point ``$EXAMPLE_DEMO_PAUSE_AT`` names, say so and await a signal."""
    if os.environ.get("EXAMPLE_DEMO_PAUSE_AT") != name:
        return
    print(f"paused at {name}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + PAUSE_LIMIT
    while not _received and time.monotonic() < deadline:
        time.sleep(0.01)
