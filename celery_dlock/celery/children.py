"""Whether a pool process has ended, as the worker process that started it sees it.

``revoke(terminate=True)`` only *sends* a signal to the pool process running the task, and
Celery announces the revoke (``task_revoked``, in the worker's parent process) right after
sending it. Whether the process ends is another matter: prefork pool processes ignore SIGINT
(and SIGTERM when the worker remaps it with ``REMAP_SIGTERM``), and a body may catch the
``SoftTimeLimitExceeded`` that SIGUSR1 raises and go on. So the parent frees a terminated
task's lease only once the process holding it is gone, and asks the kernel rather than
guessing from the signal: ``waitid(..., WNOWAIT)`` reports a child that has exited without
reaping it (billiard reaps its own children), and refuses a pid that is not a child of this
process.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from celery_dlock.core.backend import Backend
    from celery_dlock.core.holder import Holder

log = logging.getLogger("celery_dlock.release")

#: How often a watcher asks whether the process has exited (a system call, no I/O).
POLL = 0.02
#: How often it looks whether the lease is still there (the body may release it itself).
RECHECK = 1.0


class State(enum.Enum):
    RUNNING = "running"
    EXITED = "exited"  # exited; reaped or not
    NOT_MINE = "not a child"  # not a child of this process, or reaped already


def state(pid: int) -> State:
    """What this process knows of its child ``pid``, without reaping it."""
    waitid = getattr(os, "waitid", None)
    if waitid is None:  # macOS before Python 3.13: only "gone" can be seen, once reaped
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return State.NOT_MINE
        except PermissionError:
            return State.NOT_MINE  # someone else's process: not ours
        return State.RUNNING
    try:
        found = waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return State.NOT_MINE
    return State.RUNNING if found is None else State.EXITED


def release_when_ended(
    backend: Backend,
    key: str,
    holder: Holder,
    what: str,
    still_there: Callable[[Backend, str, str], bool] | None = None,
) -> bool:
    """Free ``key`` from the acquisition ``holder`` once its process (a child of this one)
    has ended; in a thread, so the worker's event loop goes on. False (nothing started) when
    ``holder.pid`` is not a child of this process, which then has nothing to say about it.
    ``still_there(backend, key, nonce)`` says whether the acquisition is still on the key
    (default: it holds it); the watch ends early once it is not."""
    if state(holder.pid) is State.NOT_MINE:
        return False
    thread = threading.Thread(
        target=_watch,
        args=(backend, key, holder, what, still_there or _holds),
        name=f"dlock-ended-{holder.pid}",
        daemon=True,
    )
    thread.start()
    return True


def _holds(backend: Backend, key: str, nonce: str) -> bool:
    current = backend.holder(key)
    return current is not None and current.nonce == nonce


def _watch(
    backend: Backend,
    key: str,
    holder: Holder,
    what: str,
    still_there: Callable[[Backend, str, str], bool],
) -> None:
    recheck = time.monotonic() + RECHECK
    while state(holder.pid) is State.RUNNING:
        if time.monotonic() >= recheck:
            recheck = time.monotonic() + RECHECK
            try:
                there = still_there(backend, key, holder.nonce)
            except Exception:  # the store is unreachable: cannot tell, keep watching
                continue
            if not there:
                log.info("%s: its process %d released %r itself", what, holder.pid, key)
                return
        time.sleep(POLL)
    try:
        if backend.release_nonce(key, holder.nonce):
            log.info("released %r of %s: its process %d has ended", key, what, holder.pid)
    except Exception:  # never raise in a worker thread; the lease expires after its ttl
        log.exception("could not release %r of %s", key, what)
