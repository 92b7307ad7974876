"""One-shot work run off the caller's thread, on a small pool made again after fork.

Neutral ground: the watchdog (any backend) and the Redis transport both use it, so it lives in
neither.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery_dlock import forks


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


#: Runs one-shot cleanup (releasing what a lost lease may still hold) off the caller's thread.
_background = ProcessPool("dlock-background", 4)


def background(fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` on a small background thread pool, not waiting for it."""
    _background.get().submit(fn, *args)
