"""One thread per process that deletes this process's forgotten timed nodes when their ttl is
up (:func:`celery_dlock.backends.zookeeper.timed.forget`)."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

from celery_dlock.core.background import BackgroundThread

log = logging.getLogger("celery_dlock.zookeeper")


class Reaper(BackgroundThread):
    """One daemon thread per process that runs jobs when due: deleting this process's
    forgotten nodes when their ttl is up. A job returns in how many seconds to run it again,
    or None; it gives up after ``TRIES`` runs (the key's next contender deletes the node
    then)."""

    TRIES = 20
    thread_name = "dlock-zk-reaper"

    def fresh(self) -> None:
        super().fresh()  # in a forked child: the parent's jobs are the parent's
        self._heap: list[tuple[float, int, int, Callable[[], float | None]]] = []
        self._serial = itertools.count()

    def add(self, due: float, job: Callable[[], float | None], tries: int = 0) -> None:
        """Run ``job`` at ``due`` (``time.monotonic()``)."""
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._serial), tries, job))
            self.start()
            self._cond.notify()

    def loop(self, cond: threading.Condition) -> None:
        while True:
            with cond:
                if not self._heap:
                    cond.wait()
                    continue
                due, _, tries, job = self._heap[0]
                left = due - time.monotonic()
                if left > 0:
                    cond.wait(left)
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
