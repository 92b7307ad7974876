"""What one uncontended lock cycle asks of the Python interpreter (issue 35), counted with
``sys.setprofile`` on a real server, never timed. ``benchmarks/README.md`` ("Folders that are
the layers (issue 35): instruction counts") has the instruction counts these calls make up."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest

from celery_dlock import lock
from celery_dlock.backends.redis.redlock import LockManager
from celery_dlock.core.config import Settings

#: String searches that parse their arguments (a tuple, then a format), which cost more
#: than the search itself: about 1.1k instructions each; a lock cycle ran three (the void key
#: at acquire, the owner and the nonce at release).
SEARCHES = {"str.index", "str.find", "str.rindex", "str.rfind"}


@pytest.fixture
def manager(single_urls: list[str]) -> Iterator[LockManager]:
    made = LockManager(Settings(urls=tuple(single_urls)))
    yield made
    made.close()


def _builtin_calls(run: Callable[[], None], times: int) -> Counter[str]:
    """The calls of built-in functions and methods ``times`` runs of ``run`` make."""
    counts: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            counts[getattr(arg, "__qualname__", repr(arg))] += 1

    run()  # connect and load the scripts first
    sys.setprofile(profile)
    try:
        for _ in range(times):
            run()
    finally:
        sys.setprofile(None)
    return counts


def test_a_managers_lock_cycle_searches_no_string(manager: LockManager) -> None:
    def cycle() -> None:
        manager.acquire("cycle", ttl=10, renew=False).release()

    counts = _builtin_calls(cycle, 10)
    assert counts["socket.sendall"] == 20, counts  # the cycle ran: two commands each time
    assert {name: n for name, n in counts.items() if name in SEARCHES} == {}


def test_a_lock_blocks_cycle_searches_no_string(single_urls: list[str]) -> None:
    def cycle() -> None:
        with lock(single_urls, "cycle", ttl=10):
            pass

    counts = _builtin_calls(cycle, 10)
    assert counts["socket.sendall"] == 20, counts
    assert {name: n for name, n in counts.items() if name in SEARCHES} == {}
