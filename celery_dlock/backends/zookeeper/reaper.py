"""One thread per process that deletes this process's forgotten timed nodes when their ttl is
up (:func:`celery_dlock.backends.zookeeper.timed.forget`)."""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("celery_dlock.zookeeper")


class Reaper:
    """One daemon thread per process that runs jobs when due: deleting this process's
    forgotten nodes when their ttl is up. A job returns in how many seconds to run it again,
    or None; it gives up after ``TRIES`` runs (the key's next contender deletes the node
    then)."""

    TRIES = 20

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # the thread did not survive the fork

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, int, Callable[[], float | None]]] = []
        self._serial = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, due: float, job: Callable[[], float | None], tries: int = 0) -> None:
        """Run ``job`` at ``due`` (``time.monotonic()``)."""
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._serial), tries, job))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dlock-zk-reaper", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._heap:
                    self._cond.wait()
                    continue
                due, _, tries, job = self._heap[0]
                left = due - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._heap)
            try:
                again = job()
            except Exception:
                log.debug("timed node clean-up failed", exc_info=True)
                again = None
            if again is not None and tries + 1 < self.TRIES:
                self.add(time.monotonic() + again, job, tries + 1)


#: This process's clean-up thread for forgotten nodes.
reaper = Reaper()
