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

import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Watch

from celery_dlock.backends.zookeeper import ZkLease, ZooKeeperBackend, close_all
from celery_dlock.backends.zookeeper.nodes import parse_name
from celery_dlock.core.errors import LockContended, LockUnavailable
from tests.support.zookeeper import (
    START_TIMEOUT,
    Ensemble,
    FaultProxy,
    ZkServer,
    ensemble,
    four_letter,
    skip_reason,
    standalone,
    until,
)

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


# -- the outage matrix ----------------------------------------------------------------------------
#
# Each outage (rows) happens while each lock operation (columns) is under way. A row ends the
# same way: what the operation told its caller is checked against the servers (a lease it
# returned is either held, or reported lost; a nonce of a hand-over is the key's queued lock),
# then the caller gives back what it holds, and a client of its own must get the key within
# the bound the test set (session timeout + timed nodes' ttl): a node that no live lease owns
# would keep it from the key for as long as the process lived.

#: ttl of the timed nodes the operations make (hand-over, queued lock, tick key), seconds.
TIMED_TTL = 2.0

OUTAGES = [
    "quorum-lost-shorter-than-the-session",
    "quorum-lost-longer-than-the-session",
    "connection-cut-during-create",
    "connection-cut-during-delete",
    "connection-cut-during-listing",
    "server-restart",
    "session-expired",
]
OPERATIONS = ["acquire", "wait", "release", "hand-over", "queued-lock", "tick-key"]


class Stage:
    """One operation on the client under test (``mine``), with an observer on its own session
    (``other``): what is set up before the outage, the call made during it, and what the
    caller was told."""

    def __init__(
        self, operation: str, mine: ZooKeeperBackend, other: ZooKeeperBackend, fresh: str
    ) -> None:
        self.operation = operation
        self.mine = mine
        self.other = other
        self.fresh = fresh  # the URL of the client that must get the key at the end
        self.key = f"m-{operation}"
        self.held: Any = None  # a lease taken before the outage
        self.theirs: Any = None  # the observer's lease on the key, taken before the outage
        self.waiting: threading.Thread | None = None
        self.outcome: Any = None  # what the call returned, or the exception it raised
        self.done = threading.Event()

    def prepare(self) -> None:
        self.mine.shared.start()  # a process that has used the ensemble before: a session
        if self.operation in ("release", "hand-over"):
            self.held = self.mine.acquire(self.key, holder="task-m")
        elif self.operation == "tick-key":
            self.held = self.mine.acquire(self.key, holder="tick-m", ttl=TIMED_TTL)
        elif self.operation == "acquire":  # a held key: its parent node exists
            self.theirs = self.other.acquire(self.key, holder="task-o")
        elif self.operation == "wait":
            self.theirs = self.other.acquire(self.key, holder="task-o")
            self.waiting = threading.Thread(target=self._call, daemon=True)
            self.waiting.start()
            until(lambda: len(self.other.queue(self.key)) == 2, 10, "the waiter queued")

    def _call(self) -> None:
        mine, key = self.mine, self.key
        try:
            if self.operation == "acquire":
                self.outcome = mine.acquire(key, wait=0, holder="task-m")
            elif self.operation == "wait":
                self.outcome = mine.acquire(key, wait=60, holder="task-m")
            elif self.operation == "release":
                self.outcome = mine.release(self.held)
            elif self.operation == "hand-over":
                self.outcome = mine.hand_over(self.held, TIMED_TTL)
            elif self.operation == "queued-lock":
                self.outcome = mine.acquire(key, queued=True, ttl=TIMED_TTL, holder="task-q")
            elif self.operation == "tick-key":
                mine.forget(self.held)
                self.outcome = None
        except Exception as exc:  # the caller's answer, checked below
            self.outcome = exc
        finally:
            self.done.set()

    def start(self) -> None:
        """The call, during the outage (on a thread: it may block until the servers answer)."""
        if self.operation == "wait":
            self.other.release(self.theirs)  # the holder goes while the waiter is cut off
        else:
            threading.Thread(target=self._call, daemon=True).start()

    def check(self, bound: float) -> None:
        """After the outage: the caller was told the truth, and the key frees within ``bound``."""
        assert self.done.wait(bound + 60), f"{self.operation}: the call never returned"
        outcome = self.outcome
        assert not isinstance(outcome, AssertionError), outcome
        if isinstance(outcome, ZkLease):
            name = parse_name(outcome.path.rsplit("/", 1)[1])
            assert name is not None
            nonce = name.nonce
            holders = [h.nonce for h in self.other.queue(self.key)]
            # Held, or reported lost: never a lease that is valid without its node.
            assert outcome.lost or outcome.valid_for == 0 or holders[:1] == [nonce], (
                self.operation,
                holders,
                nonce,
            )
            outcome.release()
        elif isinstance(outcome, str) and self.operation == "hand-over":
            assert not self.held.valid_for, "the handed-over lease stays valid"
        elif outcome is not None and not isinstance(outcome, bool):
            assert isinstance(outcome, LockUnavailable | LockContended), repr(outcome)
        if self.held is not None:
            self.mine.release(self.held)
        if self.theirs is not None:
            self.other.release(self.theirs)
        fresh = ZooKeeperBackend(self.fresh)
        try:
            with fresh.acquire(self.key, wait=bound, holder="task-fresh"):
                pass
            # Nothing left behind it either: every node of the key is gone.
            until(lambda: not fresh.queue(self.key), bound, "every node of the key gone")
        finally:
            close_all()


@pytest.fixture(scope="module")
def zk() -> Iterator[ZkServer]:
    if REASON is not None:
        pytest.skip(REASON)
    with standalone() as server:
        yield server


def _cut_when_sent(
    backend: ZooKeeperBackend, proxy: FaultProxy, kinds: tuple[str, ...], then: str = "pass"
) -> None:
    """Cut the connection (the next reply, mid-way) once a request of one of ``kinds`` (kazoo
    request class names) is sent by ``backend``'s client: that request's reply is lost (and,
    ``then="blackhole"``, nothing is relayed after it until the proxy heals)."""
    client = backend.shared.start()
    real = client._call
    armed = threading.Event()

    def call(request: Any, async_object: Any) -> Any:
        if not armed.is_set() and type(request).__name__ in kinds:
            armed.set()
            proxy.reset_mid_reply(then=then)
        return real(request, async_object)

    client._call = call


CUTS = {
    "connection-cut-during-create": ("Create2", "Transaction"),
    "connection-cut-during-delete": ("Delete", "Transaction"),
    "connection-cut-during-listing": ("GetChildren2", "GetChildren"),
}


@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize("outage", OUTAGES)
def test_outage_matrix(outage: str, operation: str, request: pytest.FixtureRequest) -> None:
    if outage.startswith("quorum"):
        _quorum_row(request.getfixturevalue("ens"), outage, operation)
    else:
        _server_row(request.getfixturevalue("zk"), outage, operation)


def _quorum_row(ens: Ensemble, outage: str, operation: str) -> None:
    """The quorum lost (two of three servers stopped) while ``operation`` is under way."""
    chroot = f"x-{uuid.uuid4().hex[:8]}"
    _quorum_back(ens)
    timeout = 30.0 if "shorter" in outage else TIMEOUT
    hosts = ens.hosts
    mine = ZooKeeperBackend(f"zookeeper://{hosts}/{chroot}?timeout={timeout:g}")
    other = ZooKeeperBackend(f"zookeeper://{hosts}/{chroot}?timeout=10")
    stage = Stage(operation, mine, other, f"zookeeper://{hosts}/{chroot}?timeout=11")
    try:
        stage.prepare()
        began = time.monotonic()
        _quorum_lost(ens)
        until(lambda: not mine.shared.connected.is_set(), timeout, "the client to see it")
        stage.start()
        if "longer" in outage:  # the outage lasts past the session timeout
            stage.done.wait(2 * timeout)
            threading.Event().wait(max(0.0, began + 2 * timeout - time.monotonic()))
        _quorum_back(ens)
        lasted = time.monotonic() - began
        if "shorter" in outage:
            assert lasted < timeout, f"the outage lasted {lasted:.1f} s"
        stage.check(2 * timeout + TIMED_TTL + 10)
    finally:
        _quorum_back(ens)
        close_all()


def _server_row(server: ZkServer, outage: str, operation: str) -> None:
    """A connection cut, a server restart or an expired session, on a standalone server,
    while ``operation`` is under way."""
    chroot = f"x-{uuid.uuid4().hex[:8]}"
    with FaultProxy(server.client_port) as proxy:
        timeout = 2.0 if outage == "session-expired" else 6.0
        via = proxy.port if outage != "server-restart" else server.client_port
        mine = ZooKeeperBackend(f"zookeeper://127.0.0.1:{via}/{chroot}?timeout={timeout:g}")
        other = ZooKeeperBackend(f"zookeeper://{server.hosts}/{chroot}?timeout=10")
        stage = Stage(operation, mine, other, f"zookeeper://{server.hosts}/{chroot}?timeout=11")
        try:
            stage.prepare()
            if outage in CUTS:
                _cut_when_sent(mine, proxy, CUTS[outage])
                stage.start()
            elif outage == "server-restart":
                server.stop()
                until(lambda: not mine.shared.connected.is_set(), timeout, "the client to see it")
                stage.start()
                server.start()
                server.wait_serving()
            else:  # session-expired: cut off until the server expires the session
                sid = mine.shared.start().client_id[0]
                proxy.blackhole()
                stage.start()
                until(
                    lambda: f"sid=0x{sid:x}" not in four_letter(server.client_port, "cons"),
                    4 * timeout,
                    "the server to expire the session",
                )
                proxy.heal()
            stage.check(2 * timeout + TIMED_TTL + 10)
        finally:
            if not server.running:
                server.start()
                server.wait_serving()
            close_all()


TABLE_ROW = re.compile(r"^\| `(?P<id>[^`]+)`[^|]*\|(?P<cells>.*)\|\s*$")
DOCS = Path(__file__).resolve().parents[3] / "docs" / "zookeeper.md"


def test_the_outage_table_and_the_matrix_agree() -> None:
    """docs/zookeeper.md's outage table marks exactly the rows this module runs."""
    section = DOCS.read_text().split("### Outages", 1)[1].split("\n#", 1)[0]
    documented = set()
    for line in section.splitlines():
        match = TABLE_ROW.match(line)
        if match is None:
            continue
        cells = [c.strip() for c in match.group("cells").split("|")][: len(OPERATIONS)]
        documented |= {
            (match.group("id"), op)
            for op, cell in zip(OPERATIONS, cells, strict=True)
            if cell == "yes"
        }
    assert documented == {(outage, op) for outage in OUTAGES for op in OPERATIONS}


def test_a_create_whose_reply_was_lost_and_whose_search_failed_leaves_no_node(
    ens: Ensemble, chroot: str
) -> None:
    """The create reaches the servers, its reply is cut, and the search by nonce cannot get
    through either (the quorum lost right after): the caller is told LockUnavailable, and the
    node that create made is found by its nonce and deleted once the same session is back."""
    timeout = 6.0
    with FaultProxy(ens.servers[0].client_port) as proxy:
        mine = ZooKeeperBackend(f"zookeeper://127.0.0.1:{proxy.port}/{chroot}?timeout={timeout:g}")
        other = ZooKeeperBackend(f"zookeeper://{ens.hosts}/{chroot}?timeout=10")
        theirs = other.acquire("lost", holder="task-o")  # the key's parent exists
        mine.shared.start()
        _cut_when_sent(mine, proxy, ("Create2",), then="blackhole")
        failed: list[BaseException] = []

        def take() -> None:
            try:
                mine.acquire("lost", wait=0, holder="task-m")
            except LockUnavailable as exc:
                failed.append(exc)

        taking = threading.Thread(target=take)
        taking.start()
        assert proxy.cut.wait(timeout)
        _quorum_lost(ens)  # no session can expire now: the node stays until we delete it
        taking.join(3 * timeout)
        assert failed, "the acquisition was not told it failed"
        proxy.heal()
        _quorum_back(ens)
        until(mine.shared.connected.is_set, START_TIMEOUT, "the same session back")
        other.release(theirs)
        fresh = ZooKeeperBackend(f"zookeeper://{ens.hosts}/{chroot}?timeout=11")
        with fresh.acquire("lost", wait=2 * timeout, holder="task-fresh"):
            pass
