"""ZooKeeper outages (issue 33): what a client is told, and what is left on the servers after.

Each test drives a real ensemble (or a standalone server, or a :class:`FaultProxy` in front of
one) through one outage while a lock call is under way, then checks two things: the caller was
told the truth (a lease it holds is valid, an error it got means it holds nothing), and once the
servers answer again no node is left that no live lease owns (another client can take the key).

Outages of a whole quorum come from stopping two of three servers: the last one stops serving
clients, sessions cannot expire (no leader), and the same session comes back when the quorum
does. Deadlines derive from the session timeouts the tests set.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Watch

from celery_dlock.errors import LockUnavailable
from celery_dlock.zookeeper import ZooKeeperBackend, close_all
from tests.zookeeper import START_TIMEOUT, Ensemble, ensemble, skip_reason, until

REASON = skip_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

#: Session timeout (s) of the clients under test: short, so an outage outlasts it quickly.
TIMEOUT = 3.0


@pytest.fixture(scope="module")
def ens() -> Iterator[Ensemble]:
    if REASON is not None:
        pytest.skip(REASON)
    with ensemble(3) as group:
        yield group


@pytest.fixture
def chroot(ens: Ensemble) -> Iterator[str]:
    _quorum_back(ens)
    yield f"o-{uuid.uuid4().hex[:8]}"
    _quorum_back(ens)
    close_all()


def _quorum_back(ens: Ensemble) -> None:
    for server in ens.servers:
        if not server.running:
            server.start()
    for server in ens.servers:
        server.wait_serving()


def _quorum_lost(ens: Ensemble) -> None:
    """Stop two of the three servers: the third stops serving clients."""
    for server in ens.servers[1:]:
        server.stop()
    until(lambda: not ens.servers[0].serving(), START_TIMEOUT, "the last server to stop serving")


def _urls(ens: Ensemble, chroot: str, timeout: float = TIMEOUT) -> tuple[str, str]:
    """The URL of the client under test and an observer's (another session: another timeout)."""
    return (
        f"zookeeper://{ens.hosts}/{chroot}?timeout={timeout:g}",
        f"zookeeper://{ens.hosts}/{chroot}?timeout=10",
    )


def _nodes(backend: ZooKeeperBackend, key: str) -> list[str]:
    return [h.nonce for h in backend.queue(key)]


def test_a_refused_acquisition_queued_during_a_quorum_loss_leaves_no_node(
    ens: Ensemble, chroot: str
) -> None:
    """``acquire(wait=0)`` while the quorum is lost: kazoo queues the create and sends it when
    the same session is back. The caller was told LockUnavailable, so the node that create
    makes must go once the quorum is back; before the fix it stayed in line, and held the key
    for as long as the process lived once the holder before it released."""
    url, observer_url = _urls(ens, chroot)
    backend = ZooKeeperBackend(url)
    observer = ZooKeeperBackend(observer_url)
    session = backend.shared
    session.start()
    held = observer.acquire("q", holder="observer")  # the key's parent exists during the outage
    _quorum_lost(ens)
    until(lambda: not session.connected.is_set(), 2 * TIMEOUT, "the client to see the loss")
    with pytest.raises(LockUnavailable):
        backend.acquire("q", wait=0)
    _quorum_back(ens)
    until(session.connected.is_set, START_TIMEOUT, "the same session back")
    # A session's requests are answered in order: this listing comes after the queued create.
    backend.queue("q")
    observer.release(held)
    until(lambda: not _nodes(observer, "q"), 2 * TIMEOUT, "the orphan node to be deleted")
    with observer.acquire("q", wait=0) as lease:
        assert lease.valid_for > 0


def test_a_release_during_a_quorum_loss_returns_at_once_and_frees_the_key_after(
    ens: Ensemble, chroot: str
) -> None:
    """A release while no server answers must not block its caller for a session timeout
    (a task's worker slot held for nothing): it returns unconfirmed at once, and the delete
    is sent when the same session is back."""
    timeout = 12.0
    url, observer_url = _urls(ens, chroot, timeout)
    backend = ZooKeeperBackend(url)
    lease = backend.acquire("r")
    session = backend.shared
    _quorum_lost(ens)
    until(lambda: not session.connected.is_set(), timeout, "the client to see the loss")
    began = time.monotonic()
    assert backend.release(lease) is False  # not confirmed
    assert time.monotonic() - began < timeout / 4
    assert lease.released
    _quorum_back(ens)
    observer = ZooKeeperBackend(observer_url)
    until(lambda: not _nodes(observer, "r"), timeout, "the owed delete to be paid")


def test_the_first_release_after_waiters_queued_notifies_only_the_next_waiter(
    ens: Ensemble, chroot: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three clients, each on its own session: A holds, B and C wait. A's release must send a
    notification to B alone: C's listing, sent with its create, carried a watch on the key's
    children that nobody's joining fired since, and that watch must not wake C too."""
    hosts = ens.hosts
    a, b, c = (ZooKeeperBackend(f"zookeeper://{hosts}/{chroot}?timeout={t}") for t in (20, 21, 22))
    events: list[tuple[object, str]] = []
    real = ConnectionHandler._read_watch_event

    def record(self: ConnectionHandler, buffer: bytes, offset: int) -> Any:
        events.append((self.client, Watch.deserialize(buffer, offset)[0].path))
        return real(self, buffer, offset)

    monkeypatch.setattr(ConnectionHandler, "_read_watch_event", record)
    held = a.acquire("n")
    admitted = {name: threading.Event() for name in "bc"}
    done = threading.Event()

    def wait_in_line(backend: ZooKeeperBackend, name: str) -> None:
        with backend.acquire("n", wait=60):
            admitted[name].set()
            done.wait(60)

    threads = [
        threading.Thread(target=wait_in_line, args=(b, "b")),
        threading.Thread(target=wait_in_line, args=(c, "c")),
    ]
    threads[0].start()
    until(lambda: len(a.queue("n")) == 2, 10, "B queued")
    threads[1].start()
    until(lambda: len(a.queue("n")) == 3, 10, "C queued")
    # Any request answered on C's session comes after every notification sent to it before.
    c.shared.client.exists("/")
    del events[:]
    held.release()
    assert admitted["b"].wait(20)
    c.shared.client.exists("/")
    b.shared.client.exists("/")
    a.shared.client.exists("/")
    seen = list(events)
    done.set()
    for thread in threads:
        thread.join(30)
    names = {a.shared.client: "A", b.shared.client: "B", c.shared.client: "C"}
    # A hears of its own node's deletion (it watches it, to notice a forced release).
    assert sorted({names[client] for client, _path in seen}) == ["A", "B"]
