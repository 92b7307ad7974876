"""Calling off acquisition attempts whose reply never came, in the background.

When a node does not answer an acquire in time we report failure at once, but that node may
still take the key later (it was only slow, or stopped and resumed), and nobody would release
it. The janitor keeps sending that node a void for the attempt (scripts.VOID: delete the key if
the attempt took it, and leave a marker that makes the attempt fail if it runs later), with
backoff, until it lands or the key would have expired anyway.

One thread per process serves every pending void, grouped by node, and tries a node that just
failed only after a pause, so a hung node costs one timeout per round, not one per attempt.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from celery_dlock import forks
from celery_dlock.transport import Node, run_script

log = logging.getLogger("celery_dlock.release")

#: First and longest pause between tries on a node that did not answer.
BACKOFF = (0.05, 1.0)


@dataclass(order=True)
class _Void:
    due: float
    seq: int
    node: Node = field(compare=False)
    lock_key: str = field(compare=False)
    void_key: str = field(compare=False)
    head: str = field(compare=False)
    until: float = field(compare=False)
    delay: float = field(compare=False, default=BACKOFF[0])


class Janitor:
    """A background thread that voids failed attempts on silent nodes."""

    def __init__(self) -> None:
        self._pid = forks.pid()
        self._cond = threading.Condition()
        self._heap: list[_Void] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def _fork_check(self) -> None:
        if self._pid != forks.pid():  # forked: the parent's pending work is not ours
            self._pid = forks.pid()
            self._cond = threading.Condition()
            self._heap = []
            self._thread = None

    def void(
        self, nodes: list[Node], lock_key: str, void_key: str, head: str, until: float
    ) -> None:
        """Void the attempt ``head`` on ``nodes`` until it lands or ``until`` (monotonic)."""
        self._fork_check()
        now = time.monotonic()
        with self._cond:
            for node in nodes:
                heapq.heappush(
                    self._heap, _Void(now, next(self._seq), node, lock_key, void_key, head, until)
                )
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dlock-janitor", daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0].due > time.monotonic():
                    timeout = self._heap[0].due - time.monotonic() if self._heap else None
                    self._cond.wait(timeout)
                due: list[_Void] = []
                now = time.monotonic()
                while self._heap and self._heap[0].due <= now:
                    due.append(heapq.heappop(self._heap))
            try:
                self._serve(due)
            except Exception:  # never die: later voids depend on this thread
                log.exception("janitor round failed")

    def _serve(self, due: list[_Void]) -> None:
        failed_nodes: set[int] = set()
        retry: list[_Void] = []
        for item in due:
            left = item.until - time.monotonic()
            if left <= 0:
                continue  # expired by itself on that node
            if id(item.node) in failed_nodes:
                retry.append(item)  # that node just failed: do not pay its timeout again
                continue
            reply = run_script(
                [item.node],
                "void",
                (item.lock_key, item.void_key),
                (item.head, max(1, round(left * 1000))),
                item.node.timeout,
            )[0]
            if isinstance(reply, BaseException):
                failed_nodes.add(id(item.node))
                retry.append(item)
            elif reply == 1:
                log.info("voided a late acquisition of %s on %s", item.lock_key, item.node.shown)
        with self._cond:
            for item in retry:
                item.due = time.monotonic() + item.delay
                item.delay = min(item.delay * 2, BACKOFF[1])
                heapq.heappush(self._heap, item)


janitor = Janitor()
