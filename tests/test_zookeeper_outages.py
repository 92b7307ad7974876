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

import uuid
from collections.abc import Iterator

import pytest

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


def _urls(ens: Ensemble, chroot: str) -> tuple[str, str]:
    """The URL of the client under test and an observer's (another session: another timeout)."""
    return (
        f"zookeeper://{ens.hosts}/{chroot}?timeout={TIMEOUT:g}",
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
