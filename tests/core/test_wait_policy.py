"""A wait that ran out says how long it waited (``on_duplicate="wait"``, ``lock(wait=)``), so
``LockContended`` after a wait does not read like an immediate refusal."""

from __future__ import annotations

import re
import time

import pytest

from celery_dlock import LockContended, lock
from tests.celery.test_task_options import define, make_app

#: What a refusal after a wait says: "... (waited 0.4 s)".
WAITED = re.compile(r"\(waited (\d+\.\d) s\)$")

MODES = ("single", "redlock5", "zookeeper")


def waited(error: BaseException) -> float:
    match = WAITED.search(str(error))
    assert match is not None, f"the error does not say how long it waited: {error}"
    return float(match.group(1))


def test_a_task_that_waited_says_so(urls: list[str]) -> None:
    app = make_app(urls)
    task = define(app, lock_key="meta:{source}:{entity}", on_duplicate="wait", lock_wait=0.4)
    with lock(app, "meta:s:e", ttl=10, holder="task-holding"):
        begun = time.monotonic()
        result = task.apply(("s", "e"))
        took = time.monotonic() - begun
    assert result.state == "FAILURE"
    assert isinstance(result.result, LockContended)
    assert "task-holding" in str(result.result)
    assert 0.4 <= waited(result.result) <= took + 0.05


def test_a_lock_that_waited_says_so(urls: list[str]) -> None:
    with lock(urls, "w", ttl=10, holder="holding"), pytest.raises(LockContended) as refused:
        lock(urls, "w", ttl=10, wait=0.3).acquire()
    assert waited(refused.value) >= 0.3
    assert "holding" in str(refused.value)


def test_an_immediate_refusal_says_nothing_of_a_wait(urls: list[str]) -> None:
    with lock(urls, "w", ttl=10, holder="holding"), pytest.raises(LockContended) as refused:
        lock(urls, "w", ttl=10).acquire()
    assert "waited" not in str(refused.value)
