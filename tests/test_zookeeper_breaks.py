"""Breaks found by trying the ZooKeeper backend the way a deployment would (issue 22).

Each test states a promise of docs/zookeeper.md and drives a real ZooKeeper server (through a
:class:`FaultProxy` where a connection must fail at a given moment) to check it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from celery_dlock.zookeeper import ZooKeeperBackend, close_all
from tests.zookeeper import FaultProxy, ZkServer, skip_reason, standalone

REASON = skip_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``check`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)  # a poll, bounded by the deadline


@pytest.fixture(scope="module")
def zk() -> Iterator[ZkServer]:
    if REASON is not None:
        pytest.skip(REASON)
    with standalone() as server:
        yield server


@pytest.fixture
def proxy(zk: ZkServer) -> Iterator[FaultProxy]:
    with FaultProxy(zk.client_port) as relay:
        yield relay
    close_all()


def _backends(zk: ZkServer, proxy: FaultProxy) -> tuple[ZooKeeperBackend, ZooKeeperBackend]:
    """One backend whose client goes through ``proxy`` (a long session: no ping or renewal
    is sent while a test swallows a request), and one observer on its own session."""
    chroot = f"b-{uuid.uuid4().hex[:8]}"
    faulty = ZooKeeperBackend(f"zookeeper://127.0.0.1:{proxy.port}/{chroot}?timeout=30")
    observer = ZooKeeperBackend(f"zookeeper://{zk.hosts}/{chroot}?timeout=5")
    return faulty, observer


def test_a_hand_over_whose_transaction_was_dropped_does_not_keep_the_key_forever(
    zk: ZkServer, proxy: FaultProxy
) -> None:
    """The connection closes as the hand-over's transaction is sent (it never reaches the
    server): the key must still be free again within the retry's ttl, not held by this
    process's session node for as long as the worker runs."""
    faulty, observer = _backends(zk, proxy)
    lease = faulty.acquire("ho", holder="task-1")
    proxy.swallow()
    faulty.hand_over(lease, 1.0)
    assert proxy.swallowed.is_set()
    until(lambda: observer.holder("ho") is None, 10, "the key to be free after the ttl")


def test_a_forgotten_tick_key_whose_transaction_was_dropped_ends_at_its_ttl(
    zk: ZkServer, proxy: FaultProxy
) -> None:
    """A beat's tick key (a forgotten lease) whose replacement never reached the server: it
    must still end at its ttl while the beat runs on, or that entry's next ticks are all
    refused as already sent."""
    faulty, observer = _backends(zk, proxy)
    lease = faulty.acquire("tick", holder="tick-1", ttl=1.0)
    proxy.swallow()
    faulty.forget(lease)
    assert proxy.swallowed.is_set()
    until(lambda: observer.holder("tick") is None, 10, "the tick key to end at its ttl")
