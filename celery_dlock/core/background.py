"""What runs in the background of one process: one base for its threads and its thread pools.

A forked child (a Celery prefork pool process) inherits its parent's objects but none of its
threads, and its locks as they were at the fork, perhaps held by a thread that no longer
exists. So everything here belongs to the process that made it: :class:`PerProcess` makes its
state again in a forked child, right after the fork (``os.register_at_fork``), before any of
the child's code can use it, and a check per call is not needed. On it:

* :class:`BackgroundThread`, one daemon thread per process, started on first use: the renewal
  watchdog (:mod:`celery_dlock.core.renewal`), the Redis janitor
  (:mod:`celery_dlock.backends.redis.janitor`), the ZooKeeper reaper
  (:mod:`celery_dlock.backends.zookeeper.reaper`);
* :class:`ProcessPool`, a small thread pool made on first use: one-shot work
  (:func:`background`) and Redis connecting.

They stop with the process: their threads are daemon threads, which do not keep the
interpreter from exiting, and which go on working while it waits for the program's own
threads (one may still hold a lock whose lease must be renewed).

Neutral ground: the watchdog (any backend) and the Redis backend both use it, so it lives in
neither.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class PerProcess:
    """State that belongs to one process: made by :meth:`fresh` at construction, and again in
    a forked child (the parent's threads, queued work and held locks are not the child's).

    For process-wide objects made once (module globals): the fork hook cannot be removed, and
    keeps the object alive for the life of the process."""

    def __init__(self) -> None:
        self.fresh()
        os.register_at_fork(after_in_child=self.fresh)

    def fresh(self) -> None:
        """Make this process's state afresh (at construction; in a forked child)."""
        raise NotImplementedError


class BackgroundThread(PerProcess):
    """One daemon thread per process running :meth:`loop`, started by :meth:`start` on first
    use (and again if its loop ended); :attr:`_cond` guards the thread's work."""

    #: The thread's name (shown by debuggers and ``threading.enumerate()``).
    thread_name = "dlock-background"

    def fresh(self) -> None:
        self._cond = self.condition()
        self._thread: threading.Thread | None = None
        #: True from the thread's start until its loop ends (cheaper than is_alive() per call).
        self._running = False

    def condition(self) -> threading.Condition:
        """The condition guarding the thread's work (reentrant unless a subclass says not)."""
        return threading.Condition()

    def start(self) -> None:
        """Start the thread unless it runs; the caller holds :attr:`_cond`."""
        if not self._running:
            self._running = True
            self._thread = threading.Thread(target=self._main, name=self.thread_name, daemon=True)
            self._thread.start()

    def _main(self) -> None:
        cond = self._cond
        try:
            self.loop(cond)
        finally:
            if cond is self._cond:  # not forked away: a later start() starts another thread
                self._running = False

    def loop(self, cond: threading.Condition) -> None:
        """The thread's work, run until the process ends; ``cond`` is :attr:`_cond` as it was
        when the thread started."""
        raise NotImplementedError


class ProcessPool(PerProcess):
    """A small persistent thread pool, made on first use and again after fork (a child must
    not submit to threads that only exist in its parent)."""

    def __init__(self, name: str, workers: int) -> None:
        self._name = name
        self._workers = workers
        super().__init__()

    def fresh(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=self._name)
            return self._pool

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` on the pool; in the caller's thread once the pool refuses new work.

        Python's thread pools refuse work from the moment the interpreter starts to exit
        (before it waits for the program's own threads), but a thread of the program may still
        hold a lock then, and its lease must go on being renewed: the work runs here instead.
        """
        try:
            return self.get().submit(fn, *args)
        except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
            done: Future[T] = Future()
            try:
                done.set_result(fn(*args))
            except BaseException as exc:  # the caller reads it from the future, as from a pool
                done.set_exception(exc)
            return done


#: Runs one-shot cleanup (releasing what a lost lease may still hold) off the caller's thread.
_background = ProcessPool("dlock-background", 4)


def background(fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` on a small background thread pool, not waiting for it."""
    _background.submit(fn, *args)
