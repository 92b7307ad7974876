"""Deletes that must land on nodes that were silent, sent again in the background.

Three kinds of work, one thread per process:

* **Voids.** When a node does not answer an acquire in time we report failure at once, but
  that node may still take the key later (it was only slow, or stopped and resumed), and
  nobody would release it. The janitor keeps sending that node a void for the attempt
  (scripts.VOID: delete the key if the attempt took it, and leave a marker that makes the
  attempt fail if it runs later).
* **Owed releases.** A lease whose acquire or renewal went unanswered on a node, or whose
  release did not reach a node (it timed out, or the node was cooling down), owes that node
  its delete (scripts.RELEASE_LATE: delete if ours, and leave markers so that a late acquire
  or renewal of that acquisition cannot bring the key back).
* **Unconfirmed reply-less releases** (:func:`.sending.send_script`) whose thread did not
  use that connection again within :data:`resends.CONFIRM_GRACE`: sent again here, with a
  reply, so that a release written into a connection the server had just closed is not lost.

Each item is retried with backoff until it lands. A node that stays silent may still run a
command it received before it stalled, whenever it resumes, so an item is not dropped when
the key would have expired but only :data:`LATE_LIMIT` seconds after that. A node that just
failed is tried again only after a pause, so a hung node costs one timeout per round, not one
per item.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_dlock.backends.redis import resends
from celery_dlock.backends.redis.nodes import Node
from celery_dlock.backends.redis.transport import run_script
from celery_dlock.core.background import BackgroundThread

log = logging.getLogger("celery_dlock.release")

#: First and longest pause between tries on a node that did not answer.
BACKOFF = (0.05, 1.0)
#: How often the janitor looks for reply-less commands left unconfirmed: a tracked command is
#: sent again between CONFIRM_GRACE and CONFIRM_GRACE + SWEEP_TICK after it went out.
SWEEP_TICK = resends.CONFIRM_GRACE / 2
#: Seconds past the key's own expiry that an item is still retried while its node is silent:
#: a node stalled that long may still run a stale acquire when it resumes.
LATE_LIMIT = 300.0


#: Scripts whose ARGV[2] is a marker's ttl, set when the script is sent.
_MARKING = ("void", "release_late")


@dataclass(order=True)
class _Item:
    due: float
    seq: int
    node: Node = field(compare=False)
    name: str = field(compare=False)  # the script
    keys: tuple[str, ...] = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)
    until: float = field(compare=False)  # when the key expires unless a late command runs
    ttl: float = field(compare=False)  # the lease's ttl: a late command's key lives that long
    delay: float = field(compare=False, default=BACKOFF[0])
    failures: int = field(compare=False, default=0)


class Janitor(BackgroundThread):
    """A background thread that lands voids and owed releases on silent nodes."""

    thread_name = "dlock-janitor"

    def __init__(self) -> None:
        super().__init__()
        resends.sweeper = self.wake

    def fresh(self) -> None:
        super().fresh()  # in a forked child: the parent's pending work is not ours
        self._heap: list[_Item] = []
        self._seq = itertools.count()
        self._next_sweep = 0.0

    def void(
        self, nodes: Sequence[Node], lock_key: str, void_key: str, head: str, until: float
    ) -> None:
        """Void the attempt ``head`` on ``nodes`` until it lands (see the module docstring)."""
        ttl = max(0.0, until - time.monotonic())
        self._push([(node, "void", (lock_key, void_key), (head, 0)) for node in nodes], until, ttl)

    def release(
        self,
        nodes: Sequence[Node],
        keys: tuple[str, str, str, str],
        args: tuple[Any, ...],
        until: float,
        ttl: float,
    ) -> None:
        """Land a RELEASE_LATE (``keys``, ``args`` as that script takes them) on ``nodes``."""
        self._push([(node, "release_late", keys, args) for node in nodes], until, ttl)

    def _push(
        self, work: list[tuple[Node, str, tuple[str, ...], tuple[Any, ...]]], until: float,
        ttl: float,
    ) -> None:  # fmt: skip
        now = time.monotonic()
        with self._cond:
            for node, name, keys, args in work:
                item = _Item(now, next(self._seq), node, name, keys, args, until, ttl)
                heapq.heappush(self._heap, item)
            self.start()
            self._cond.notify()

    def wake(self) -> None:
        """Called by :mod:`.resends` when a connection first carries a tracked command."""
        with self._cond:
            self.start()
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._heap)

    def loop(self, cond: threading.Condition) -> None:
        while True:
            with cond:
                due = self._next_round()
            try:
                self._serve(due)
            except Exception:  # never die: later work depends on this thread
                log.exception("janitor round failed")

    def _next_round(self) -> list[_Item]:
        """Wait (holding the condition) until items are due; take them. While connections
        carry tracked commands, look at them every SWEEP_TICK (no wake-up per release)."""
        while True:
            now = time.monotonic()
            if resends.tracking() and now >= self._next_sweep:
                self._next_sweep = now + SWEEP_TICK
                for node, (name, keys, args, until) in resends.overdue(now):
                    log.debug(
                        "%s: a reply-less %s was not confirmed within %g s; sending it again",
                        node.shown,
                        name,
                        resends.CONFIRM_GRACE,
                    )
                    item = _Item(
                        now, next(self._seq), node.owner or node, name, keys, args, until,
                        max(0.0, until - now),
                    )  # fmt: skip  # a Cluster shard's command goes through its cluster
                    heapq.heappush(self._heap, item)
            first = self._heap[0].due if self._heap else math.inf
            if first <= now:
                break
            sweep = self._next_sweep if resends.tracking() else math.inf
            wake = min(first, sweep)
            self._cond.wait(None if wake == math.inf else wake - now)
        out: list[_Item] = []
        while self._heap and self._heap[0].due <= now:
            out.append(heapq.heappop(self._heap))
        return out

    def _serve(self, due: list[_Item]) -> None:
        failed_nodes: set[int] = set()
        retry: list[_Item] = []
        try:
            for item in due:
                try:
                    self._serve_one(item, failed_nodes, retry)
                except Exception:  # one bad item (a key no node can take) costs only itself
                    log.exception(
                        "dropped a %s of %r on %s: it cannot be sent", item.name,
                        item.keys[0], item.node.shown,
                    )  # fmt: skip
        finally:
            with self._cond:
                for item in retry:
                    item.due = time.monotonic() + item.delay
                    item.delay = min(item.delay * 2, BACKOFF[1])
                    heapq.heappush(self._heap, item)

    def _serve_one(self, item: _Item, failed_nodes: set[int], retry: list[_Item]) -> None:
        now = time.monotonic()
        if now > item.until + LATE_LIMIT:
            if item.name != "void":
                log.warning(
                    "gave up releasing %s on %s: silent for %g s past its expiry",
                    item.keys[0], item.node.shown, LATE_LIMIT,
                )  # fmt: skip
            return
        if id(item.node) in failed_nodes:
            retry.append(item)  # that node just failed: do not pay its timeout again
            return
        # A marker must outlive any late command: the key's own expiry, or a full ttl
        # from now when we are past it (a node resuming runs what it had received).
        args = item.args
        if item.name in _MARKING:
            marker = max(item.until - now, item.ttl, 0.001)
            args = (args[0], max(1, round(marker * 1000)), *args[2:])
        reply = run_script([item.node], item.name, item.keys, args, item.node.timeout)[0]
        if isinstance(reply, BaseException):
            failed_nodes.add(id(item.node))
            item.failures += 1
            if item.failures == 1 and item.name != "void":
                log.warning(
                    "release of %s did not reach %s (%s); retrying until it lands, it "
                    "expires there within %.3g s unless the node runs a stale command",
                    item.keys[0], item.node.shown, reply, max(0.0, item.until - now),
                )  # fmt: skip
            retry.append(item)
        elif reply == 1:
            what = "voided a late acquisition" if item.name == "void" else "released"
            log.info("%s of %s on %s", what, item.keys[0], item.node.shown)


janitor = Janitor()
