"""Breaks found by trying the ZooKeeper backend the way a deployment would (issue 22).

Each test states a promise of docs/zookeeper.md and drives a real ZooKeeper server (through a
:class:`FaultProxy` where a connection must fail at a given moment) to check it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from functools import partial

import pytest

from celery_dlock.backends.zookeeper import ZooKeeperBackend, close_all
from celery_dlock.core.errors import LockUnavailable
from tests.support.zookeeper import (
    FaultProxy,
    ZkServer,
    four_letter,
    skip_reason,
    standalone,
    until,
)

REASON = skip_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


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


def test_a_release_whose_delete_was_dropped_frees_the_key_once_reconnected(
    zk: ZkServer, proxy: FaultProxy
) -> None:
    """The connection closes as a release's delete is sent: the key must be free once the
    same session is back, each of many times (the delete is owed and paid on reconnection)."""
    faulty, observer = _backends(zk, proxy)
    for round_ in range(15):
        lease = faulty.acquire("rel")
        proxy.swallow()
        lease.release()
        until(proxy.swallowed.is_set, 5, "the delete dropped")
        until(lambda: observer.holder("rel") is None, 5, f"the key free (round {round_})")


def _total_watches(zk: ZkServer) -> int:
    """The watches the server holds for all sessions (its ``wchs`` four-letter word)."""
    for line in four_letter(zk.client_port, "wchs").splitlines():
        if line.startswith("Total watches:"):
            return int(line.split(":", 1)[1])
    raise AssertionError("wchs gave no total")


def test_contended_cycles_leave_no_watches_behind(zk: ZkServer) -> None:
    """Two clients taking one key in turn, 200 times each: no watch may outlive its node.

    A watch set by ``exists`` on a node already gone waits for that name to be created, which
    a sequential name never is: the client keeps its callback and the servers the watch, for
    as long as the session lasts (a worker's lifetime), and every reconnection sends them all
    again."""
    chroot = f"w-{uuid.uuid4().hex[:8]}"
    one = ZooKeeperBackend(f"zookeeper://{zk.hosts}/{chroot}?timeout=5")
    two = ZooKeeperBackend(f"zookeeper://{zk.hosts}/{chroot}?timeout=5.5")
    before = _total_watches(zk)

    def cycles(backend: ZooKeeperBackend) -> None:
        for _ in range(200):
            backend.acquire("w", wait=30).release()

    other = threading.Thread(target=cycles, args=(two,))
    other.start()
    cycles(one)
    other.join(60)
    assert not two.queue("w")
    # Each process may keep a watch or two (the last listing's), not one per cycle.
    until(lambda: _total_watches(zk) - before <= 4, 5, "the watches of deleted nodes to go")
    for backend in (one, two):
        left = [p for p in backend.shared.client._data_watchers if "/w/" in p]
        assert len(left) <= 2, f"{len(left)} data watchers left on deleted nodes"
    close_all()


def test_nodes_of_another_zookeeper_user_are_refused_naming_the_fix(zk: ZkServer) -> None:
    """A chroot whose nodes another digest user made (their ACL lets only that user in): the
    error names the URL, says what is wrong and how to fix it, and never shows a password."""
    chroot = f"a-{uuid.uuid4().hex[:8]}"
    alice = ZooKeeperBackend(f"zookeeper://alice:s3cret@{zk.hosts}/{chroot}?timeout=5")
    alice.acquire("k").release()
    for who in ("bob:pw-b0b@", ""):
        stranger = ZooKeeperBackend(f"zookeeper://{who}{zk.hosts}/{chroot}?timeout=5.5")
        for call in (partial(stranger.acquire, "k"), stranger.locks):
            with pytest.raises(LockUnavailable) as caught:
                call()
            message = str(caught.value)
            assert "ACL" in message, message
            assert "user:password@" in message, message
            assert "pw-b0b" not in message, message
            assert "s3cret" not in message, message
    close_all()


def test_a_delete_owed_while_connected_is_paid_at_once(zk: ZkServer) -> None:
    # A release whose delete failed is owed, and owed deletes were paid only when the
    # connection came back; one owed after the reconnection (the releasing thread was late)
    # waited for the next reconnection, the key held meanwhile.
    url = f"zookeeper://{zk.hosts}/owed-{uuid.uuid4().hex[:8]}?timeout=4"
    try:
        backend = ZooKeeperBackend(url)
        lease = backend.acquire("k")
        session = backend.shared
        session.owe(lease.path)  # as a release whose reply was lost while connected would
        until(lambda: backend.holder("k") is None, 5, "the owed delete to be paid")
        assert session.owed == set()
        lease.release()  # its node is gone already: nothing more to do
    finally:
        close_all()
