"""Stopping a task body whose lease was lost, from the watchdog thread that noticed.

A body that goes on after its lease is gone is no longer exclusive, so by default it is
stopped with :class:`~celery_dlock.LockLost`:

* in a process's main thread (prefork children, the solo pool) a real-time signal is sent to
  the process; its handler raises ``LockLost`` in the body, which also breaks ``time.sleep``
  and blocking socket calls, like Celery's soft time limit does;
* in any other thread (the threads pool) the exception is set asynchronously on that thread
  (``PyThreadState_SetAsyncExc``); it lands at the next Python bytecode, so a body blocked in
  a long C call (a socket read, ``time.sleep``) notices only when that call returns.

Either way the body is interrupted only while it is running: once it has returned, a late
signal is ignored and a pending asynchronous exception is cleared. Nor is a body interrupted
that has already been told: when its own ``lease.ensure()`` raises ``LockLost``, an interrupt
still on its way is called off, so it cannot land in the body's own handling of that error
(a retry, say) and turn it into a failure.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from typing import Any

from celery_dlock.core.errors import LockLost
from celery_dlock.core.lease import Lease

log = logging.getLogger("celery_dlock.renew")

#: The signal used in main threads; real-time, so no other Celery or billiard handler uses it.
SIGNAL: int | None = getattr(signal, "SIGRTMIN", None)
if SIGNAL is not None:
    SIGNAL += 3


class LockLostInterrupt(LockLost):
    """What lands in the body: the lease's own facts (message, key, reason, fencing token).

    Made with no arguments where it lands (the asynchronous exception is instantiated in the
    interrupted thread), so it reads them from that thread's run; the task turns it into the
    lease's own :class:`LockLost` once the body has unwound.
    """

    def __init__(self) -> None:
        run = _runs.get(threading.get_ident())
        error = run.error if run is not None else None
        if error is None:
            super().__init__("lease lost while the task ran", reason="lost while running")
        else:
            super().__init__(str(error), key=error.key, reason=error.reason, token=error.token)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (a result backend, a pool's pipe) as the plain LockLost it stands for.
        return (LockLost, self.args, self.__dict__)


class Run:
    """One running body that may be interrupted."""

    __slots__ = ("_lease", "active", "delivered", "error", "main", "requested", "thread")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.main = self.thread == threading.main_thread().ident
        self.active = True
        self.requested = False
        self.delivered = False  # LockLost reached the body: by this interrupt, or by ensure()
        self._lease: Lease | None = None
        #: The lease's LockLost, given by whoever asked for the interrupt.
        self.error: LockLost | None = None

    @property
    def lease(self) -> Lease | None:
        """The lease whose loss stops this body (set once acquired)."""
        return self._lease

    @lease.setter
    def lease(self, lease: Lease) -> None:
        self._lease = lease
        # The lease core knows nothing of bodies: it only calls back when its ensure()
        # reports the loss, so that an interrupt for it is called off (see told()).
        lease._told = told

    def on_lost(self, lease: Lease, error: LockLost) -> None:
        """The lease's loss callback (watchdog thread): interrupt this body."""
        interrupt(self, error)


#: Added to the warning when a body cannot be interrupted because it runs in a greenlet.
GREEN_NOTE = (
    ": it is a greenlet (gevent or eventlet pool), which cannot be interrupted; the body runs "
    "to its end, then its task fails with LockLost"
)


def green() -> bool:
    """True if gevent or eventlet has made this process's threads greenlets."""
    monkey: Any = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        return True
    return eventlet()


def eventlet() -> bool:
    """True if eventlet has made this process's threads greenlets: in a worker, the eventlet
    pool, which (unlike gevent's) enforces no time limit."""
    patcher: Any = sys.modules.get("eventlet.patcher")
    return patcher is not None and bool(patcher.is_monkey_patched("thread"))


_lock = threading.Lock()
_runs: dict[int, Run] = {}  # thread ident -> its running body
_handler_installed = False


def _on_signal(signum: int, frame: Any) -> None:
    # Runs in the main thread between bytecodes; takes no locks (the main thread may hold one).
    run = _runs.get(threading.get_ident())
    if run is not None and run.active and run.requested and not run.delivered:
        run.delivered = True
        raise LockLostInterrupt()


def start() -> Run:
    """Mark the current thread's body as interruptible; call from the thread running it."""
    global _handler_installed
    run = Run()
    if run.main and SIGNAL is not None and not _handler_installed:
        signal.signal(SIGNAL, _on_signal)
        _handler_installed = True
    with _lock:
        _runs[run.thread] = run
    return run


def stop(run: Run) -> None:
    """The body has ended: no interruption may land after this returns. Only the first call
    for a run does anything, so every way out of a body may call it."""
    if not run.active:
        return
    # Before taking the lock: the watchdog may hold it while it signals this very thread, and
    # the handler, running as soon as we get the lock, must then find the body over.
    run.active = False
    with _lock:
        _runs.pop(run.thread, None)
        if run.requested and not run.main:
            # Clear it if it has not landed yet (a no-op if it has).
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(run.thread), None)


def told(lease: Lease) -> None:
    """``lease.ensure()`` is raising ``LockLost`` in this thread: its body knows, so an
    interrupt for that lease must not land on top (in the body's ``except`` clause, say)."""
    run = _runs.get(threading.get_ident())
    if run is None or run.lease is not lease:
        return
    with _lock:
        run.delivered = True  # a signal already sent finds the body told, and does nothing
        if run.requested and not run.main:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(run.thread), None)


def interrupt(run: Run, error: LockLost | None = None) -> None:
    """Raise ``LockLost`` (with ``error``'s facts) in ``run``'s body if it is still running;
    callable from any thread."""
    with _lock:
        if not run.active or run.requested or run.delivered:
            return
        run.error = error
        run.requested = True
        if run.main and SIGNAL is not None and _handler_installed:
            os.kill(os.getpid(), SIGNAL)
        else:
            done = ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(run.thread), ctypes.py_object(LockLostInterrupt)
            )
            if done != 1:
                log.warning(
                    "cannot interrupt thread %s, whose lease was lost%s",
                    run.thread,
                    GREEN_NOTE if green() else "",
                )
