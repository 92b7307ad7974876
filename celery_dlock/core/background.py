"""One-shot work run off the caller's thread, on a small pool made again after fork.

Neutral ground: the watchdog (any backend) and the Redis transport both use it, so it lives in
neither.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from celery_dlock.core import forks

T = TypeVar("T")


class ProcessPool:
    """A small persistent thread pool, made on first use and again after fork (a child must
    not submit to threads that only exist in its parent)."""

    def __init__(self, name: str, workers: int) -> None:
        self._name = name
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._pid = forks.pid()
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != forks.pid():
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=self._name)
                self._pid = forks.pid()
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
