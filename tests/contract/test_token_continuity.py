"""Fencing tokens keep rising across a switch of backend (issue 33): a store that has seen the
tokens of one backend accepts the next backend's writers, and the first backend's again after.

Redis floors its tokens at the server clock in microseconds; ZooKeeper's are the key's parent
node's creation time in microseconds (on the leader's clock) plus a per-key count of changes
(docs/guarantees.md, "Fencing tokens"), so going back to ZooKeeper needs the key's parent to
have been removed meanwhile (a minute after its last node, by default). Both servers run on
this host, so one clock.
"""

from __future__ import annotations

import pytest
import redis

from celery_dlock import lock
from celery_dlock.backends.zookeeper import ZooKeeperBackend
from celery_dlock.core.lease import Lease
from tests.support.zookeeper import until


class FencedStore:
    """A resource that remembers the highest token it accepted and refuses a lower one (the
    check a fenced write does at the storage, as in Kleppmann's note)."""

    def __init__(self) -> None:
        self.highest = 0
        self.accepted: list[tuple[str, int]] = []

    def write(self, writer: str, token: int) -> None:
        if token <= self.highest:
            raise AssertionError(
                f"{writer}'s token {token} is not above the highest accepted {self.highest}: "
                f"{self.accepted}"
            )
        self.highest = token
        self.accepted.append((writer, token))


def _write(store: FencedStore, urls: list[str], writer: str, times: int = 3) -> None:
    for _ in range(times):
        with lock(urls, "fenced-resource") as lease:
            assert isinstance(lease, Lease)
            store.write(writer, lease.token)


@pytest.mark.local_redis
def test_tokens_keep_rising_from_redis_to_zookeeper_and_back(
    single_urls: list[str], zookeeper_urls: list[str]
) -> None:
    store = FencedStore()
    _write(store, single_urls, "redis")
    _write(store, zookeeper_urls, "zookeeper")
    _write(store, single_urls, "redis again")
    # Back to ZooKeeper once the key's parent node is gone (the servers delete an empty one
    # within znode.container.checkIntervalMs, 500 ms on the test servers, a minute by
    # default): the next parent's creation time is the floor of the key's next tokens.
    zk = ZooKeeperBackend(zookeeper_urls[0])
    client = zk.shared.start()
    parent = zk.parent("fenced-resource")
    until(lambda: client.exists(parent) is None, 60, "the key's empty parent node removed")
    _write(store, zookeeper_urls, "zookeeper again")
    assert [writer for writer, _ in store.accepted][::3] == [
        "redis",
        "zookeeper",
        "redis again",
        "zookeeper again",
    ]


@pytest.mark.local_redis
def test_redlock_after_zookeeper_keeps_rising_once_its_fence_counters_are_deleted(
    redlock_urls: list[str], zookeeper_urls: list[str]
) -> None:
    """Redlock floors a counter at the clock only when it is missing, so counters kept from
    before a ZooKeeper period stay below ZooKeeper's tokens: the documented step
    (docs/guarantees.md, "Switching backends") deletes them on every node when switching
    back, and the tokens rise again."""
    store = FencedStore()
    _write(store, redlock_urls, "redlock")
    _write(store, zookeeper_urls, "zookeeper")
    nodes = [redis.Redis.from_url(url) for url in redlock_urls]
    try:
        kept = [node.get("dlock:{fenced-resource}:fence") for node in nodes]
        assert all(kept), kept
        assert max(int(value) for value in kept if value) < store.highest  # without the step
        for node in nodes:
            for name in node.scan_iter(match="dlock:*:fence"):
                node.delete(name)
    finally:
        for node in nodes:
            node.close()
    _write(store, redlock_urls, "redlock again")
