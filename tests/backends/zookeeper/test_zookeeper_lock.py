"""The ZooKeeper backend on real servers (Debian's zookeeper package, see
tests/support/zookeeper.py).

Each test asserts the behaviour its name states. Synchronisation is by polls with deadlines
(:func:`until`), never by bare sleeps.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import lock
from celery_dlock.backends.zookeeper import ZkLease, ZooKeeperBackend, close_all, parse
from celery_dlock.backends.zookeeper.acquire import renew_every
from celery_dlock.backends.zookeeper.session import shared
from celery_dlock.core.backend import Backend
from celery_dlock.core.config import Settings
from celery_dlock.core.errors import ConfigError, LockContended, LockLost
from celery_dlock.core.lease import Lease
from celery_dlock.core.urls import backend_module
from tests.support.zookeeper import (
    Ensemble,
    FaultProxy,
    ZkServer,
    ensemble,
    skip_reason,
    standalone,
    until,
)

REASON = skip_reason()
needs_zk = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def queued(backend: ZooKeeperBackend, key: str, n: int) -> bool:
    """True once ``key`` has ``n`` nodes (its holder and waiters)."""
    return len(backend.queue(key)) == n


# -- URLs (no server) ---------------------------------------------------------------------------


def test_url_parses_hosts_chroot_credentials_and_timeout() -> None:
    url = parse("zookeeper://me:s%40cret@h1:2181,h2,[::1]:2182/celery-dlock/x?timeout=7.5")
    assert url.hosts == (("h1", 2181), ("h2", 2181), ("::1", 2182))
    assert url.chroot == "/celery-dlock/x"
    assert (url.user, url.password, url.timeout) == ("me", "s@cret", 7.5)
    assert url.connect_string == "h1:2181,h2:2181,[::1]:2182"
    assert "s@cret" not in url.shown
    assert "s@cret" not in repr(url)
    assert parse("zookeeper://h1").chroot == "/celery-dlock"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://h1:6379", "not a zookeeper:// URL"),
        ("zookeeper:///chroot", "names no server"),
        ("zookeeper://h1:99999/x", "out of range"),
        ("zookeeper://h1:2181,,h2/x", "is not host or host:port"),
        ("zookeeper://h1,h1/x", "listed twice"),
        ("zookeeper://h1/x?timeout=0", "not a positive number"),
        ("zookeeper://h1/x?timout=3", "did you mean 'timeout'"),
        ("zookeeper://h1/a/../b", "not a valid ZooKeeper path"),
        ("zookeeper://me@h1/x", "user:password"),
        ("zookeeper://h1/x?timeout=3&timeout=4", "given twice"),
        # TLS (zookeepers://); the options with files are in
        # tests/backends/zookeeper/test_zookeeper_tls.py
        ("zookeeper://h1/x?ssl_ca_certs=/ca.pem", "TLS option and this is a plain zookeeper://"),
        ("zookeepers://h1/x?ssl_ca_cert=/ca.pem", "did you mean 'ssl_ca_certs'"),
        ("zookeepers://h1/x?ssl_cert_reqs=maybe", "is not one of required, optional, none"),
        ("zookeepers://h1/x?ssl_check_hostname=perhaps", "is not true or false"),
        ("zookeepers://h1/x?ssl_cert_reqs=none&ssl_check_hostname=1", "needs the certificate"),
        ("zookeepers://h1/x?ssl_ca_certs=/no/such/ca.pem", "is not a file"),
        ("zookeepers://h1/x?ssl_certfile=", "ssl_certfile is empty"),
        ("zookeepers://h1/x?ssl_password=pw", "ssl_password without a client key"),
    ],
)
def test_bad_url_names_the_setting_the_value_and_the_fix(url: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(url, "dlock_urls")
    message = str(caught.value)
    assert message.startswith("dlock_urls: ")
    assert says in message
    assert ";" in message  # problem; fix


def test_bad_url_hides_the_password() -> None:
    with pytest.raises(ConfigError) as caught:
        parse("zookeeper://me:topsecret@h1:0/x")
    assert "topsecret" not in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        parse("zookeepers://me:top/sec?ret@h1:0/x?ssl_pasword=keypass")  # raw '/', '?'; typo
    assert "percent-encode '/'" in str(caught.value)
    for secret in ("top", "sec", "ret", "keypass"):
        assert secret not in str(caught.value)


def test_zookeepers_url_turns_tls_on_verified_and_hostname_checked_by_default() -> None:
    """The defaults of redis-py's rediss:// (kazoo's own check_hostname default is off)."""
    url = parse("ZooKeepers://h1:2281,h2:2281/app?ssl_cert_reqs=optional")
    assert url.scheme == "zookeepers"
    assert url.shown == "zookeepers://h1:2281,h2:2281/app?ssl_cert_reqs=optional"
    assert url.kazoo_args() == {
        "use_ssl": True,
        "ca": None,
        "certfile": None,
        "keyfile": None,
        "keyfile_password": "",
        "verify_certs": True,
        "check_hostname": True,
    }
    unverified = parse("zookeepers://h1/app?ssl_cert_reqs=NONE").kazoo_args()
    assert (unverified["verify_certs"], unverified["check_hostname"]) == (False, False)
    assert (
        parse("zookeepers://h1/app?ssl_check_hostname=no").kazoo_args()["check_hostname"] is False
    )
    assert parse("zookeeper://h1/app").kazoo_args() == {}
    assert parse("zookeeper://h1/app").client_key() != parse("zookeepers://h1/app").client_key()


def test_bad_prefix_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="dlock_prefix 'a/b' cannot name a ZooKeeper node"):
        ZooKeeperBackend("zookeeper://h1/x", prefix="a/b")


def test_a_zookeeper_url_in_settings_makes_this_backend() -> None:
    """config dispatches on the URL's scheme; the backend keeps the Backend protocol (mypy
    checks the annotation below)."""
    settings = Settings(urls=("zookeeper://h1:2181,h2:2181/app?timeout=5",), prefix="locks")
    backend: Backend = backend_module(settings.urls).make_backend(settings)
    assert isinstance(backend, ZooKeeperBackend)
    assert backend.settings is settings
    assert backend.endpoints() == [
        "zookeeper://h1:2181/app/locks",
        "zookeeper://h2:2181/app/locks",
    ]
    with pytest.raises(ConfigError, match="one URL names a whole ensemble"):
        Settings(urls=("zookeeper://h1/a", "zookeeper://h2/b"))
    with pytest.raises(ConfigError, match="mixes kinds of lock store"):
        Settings(urls=("zookeeper://h1/a", "redis://h2:6379"))


# -- a standalone server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zk() -> Iterator[ZkServer]:
    if REASON is not None:
        pytest.skip(REASON)
    with standalone() as server:
        yield server


@pytest.fixture
def url(zk: ZkServer) -> Iterator[str]:
    """A fresh chroot on the standalone server; every client of this process closed after."""
    yield f"zookeeper://{zk.hosts}/t-{uuid.uuid4().hex[:8]}?timeout=4"
    close_all()


def _second_client(url: str) -> ZooKeeperBackend:
    """A backend on another session (another client) of the same servers."""
    return ZooKeeperBackend(url.replace("timeout=4", "timeout=4.5"))


@needs_zk
def test_threads_never_hold_a_key_together(url: str) -> None:
    backend = ZooKeeperBackend(url)
    inside = 0
    overlaps = 0
    cycles = 0
    guard = threading.Lock()

    def work() -> None:
        nonlocal inside, overlaps, cycles
        for _ in range(15):
            with backend.acquire("mutex", wait=30):
                with guard:
                    inside += 1
                    overlaps += inside > 1
                time.sleep(0.001)  # hold it a little: widen any window for an overlap
                with guard:
                    inside -= 1
                    cycles += 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert cycles == 90
    assert overlaps == 0


def _process_worker(url: str, marker: str, rounds: int, out: Any) -> None:
    """In a forked child: take the key, prove nobody else is inside, leave."""
    backend = ZooKeeperBackend(url)
    tokens = []
    violations = 0
    for _ in range(rounds):
        with backend.acquire("procs", wait=60) as lease:
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                violations += 1
            else:
                os.close(fd)
                os.unlink(marker)
            tokens.append(lease.token)
    out.put((os.getpid(), violations, tokens, shared(backend.url).client.client_id))
    close_all()


@needs_zk
def test_forked_processes_never_hold_a_key_together_each_on_its_own_session(url: str) -> None:
    backend = ZooKeeperBackend(url)
    with backend.acquire("procs") as parent_lease:  # the parent's client exists before fork
        parent_session = shared(backend.url).client.client_id
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        marker = str(Path(tmp) / "inside")
        procs = [ctx.Process(target=_process_worker, args=(url, marker, 10, out)) for _ in range(3)]
        for proc in procs:
            proc.start()
        results = [out.get(timeout=90) for _ in procs]
        for proc in procs:
            proc.join(30)
    assert all(proc.exitcode == 0 for proc in procs)
    assert sum(violations for _, violations, _, _ in results) == 0
    sessions = {session for _, _, _, session in results}
    assert len(sessions) == 3
    assert parent_session not in sessions
    tokens = sorted(t for _, _, ts, _ in results for t in ts)
    assert len(set(tokens)) == 30
    assert tokens[0] > parent_lease.token


@needs_zk
def test_waiters_are_admitted_in_arrival_order(url: str) -> None:
    backend = ZooKeeperBackend(url)
    other = _second_client(url)
    first = backend.acquire("fifo")
    admitted: list[int] = []

    def wait_turn(n: int) -> None:
        with (backend if n % 2 else other).acquire("fifo", wait=30):
            admitted.append(n)

    threads = []
    for n in range(6):
        thread = threading.Thread(target=wait_turn, args=(n,))
        thread.start()
        threads.append(thread)
        until(partial(queued, backend, "fifo", n + 2), 10, f"waiter {n} queued")
    first.release()
    for thread in threads:
        thread.join(30)
    assert admitted == list(range(6))


@needs_zk
def test_a_release_wakes_only_the_next_waiter(url: str) -> None:
    """No herd: each waiter watches its predecessor, so a release makes one waiter re-list."""
    backend = ZooKeeperBackend(url)
    watcher = _second_client(url)  # the test's own polls, on another client
    first = backend.acquire("herd")
    threads = [
        threading.Thread(target=lambda: backend.acquire("herd", wait=30).release())
        for _ in range(4)
    ]
    for n, thread in enumerate(threads):
        thread.start()
        until(partial(queued, watcher, "herd", n + 2), 10, f"waiter {n} queued")
    client = shared(backend.url).client
    seen: list[str] = []
    real_call = client._call

    def counting(request: Any, async_object: Any) -> Any:
        seen.append(type(request).__name__)
        return real_call(request, async_object)

    client._call = counting
    try:
        first.release()
        until(lambda: not watcher.queue("herd"), 20, "every waiter served")
    finally:
        del client._call
    for thread in threads:
        thread.join(10)
    # Per hand-over: the woken waiter lists once at most (the holder's direct successor not at
    # all, unless its wait outlasted a third of the session timeout: its listing showed it
    # second, so the holder's delete alone admits it) and later deletes its node; its watches
    # (on its predecessor and its own node) were set while it queued. A herd would list
    # once per waiter per release: 4 + 3 + 2 + 1.
    assert 3 <= seen.count("GetChildren2") <= 4
    assert seen.count("Exists") == 0
    assert seen.count("Delete") == 5


@needs_zk
def test_a_refusal_costs_one_create_and_one_list(url: str) -> None:
    backend = ZooKeeperBackend(url)
    other = _second_client(url)
    held = backend.acquire("drop", holder="task-a")
    client = shared(other.url).start()
    seen: list[str] = []
    real_call = client._call

    def counting(request: Any, async_object: Any) -> Any:
        seen.append(type(request).__name__)
        return real_call(request, async_object)

    client._call = counting
    try:
        with pytest.raises(LockContended) as caught:
            other.acquire("drop", wait=0)
    finally:
        del client._call
    held.release()
    assert caught.value.holder is not None
    assert caught.value.holder.task_id == "task-a"
    assert caught.value.holder.fence == held.token
    # create + list (one round trip), then the holder's identity and our delete (one more)
    assert sorted(seen) == ["Create2", "Delete", "GetChildren2", "GetData"]


@needs_zk
def test_a_free_key_costs_one_create_one_list_and_one_delete(url: str) -> None:
    backend = ZooKeeperBackend(url)
    backend.acquire("warm").release()  # parent nodes made, session up
    client = shared(backend.url).client
    seen: list[str] = []
    real_call = client._call

    def counting(request: Any, async_object: Any) -> Any:
        seen.append(type(request).__name__)
        return real_call(request, async_object)

    client._call = counting
    try:
        for _ in range(3):
            seen.clear()
            backend.acquire("warm").release()
            # The servers may have removed the empty parent (a container) just before:
            # that cycle made it again; measure another.
            if "_CreateContainer" not in seen:
                break
    finally:
        del client._call
    assert seen == ["Create2", "GetChildren2", "Delete"]  # as many as kazoo's Lock


@needs_zk
def test_holding_many_leases_costs_one_request_per_renewal_not_one_per_lease(url: str) -> None:
    """The watchdog confirms the session, which proves every node of it: holding 50 leases
    over a session timeout costs a few requests, not 50 per renewal (issue 33)."""
    backend = ZooKeeperBackend(url)
    leases = [backend.acquire(f"many-{n}") for n in range(50)]
    client = shared(backend.url).client
    seen: list[str] = []
    real_call = client._call

    def counting(request: Any, async_object: Any) -> Any:
        seen.append(type(request).__name__)
        return real_call(request, async_object)

    timeout = backend.shared.negotiated
    renewals_before = leases[0].renewals
    client._call = counting
    try:
        threading.Event().wait(timeout)  # the window measured: one session timeout
    finally:
        del client._call
    every = renew_every(timeout)
    assert leases[0].renewals > renewals_before  # renewed meanwhile, and still valid
    assert all(lease.valid_for > 0 for lease in leases)
    assert seen.count("Exists") <= timeout / every + 2, seen
    for lease in leases:
        lease.release()


@needs_zk
def test_fencing_tokens_strictly_increase_across_clients(url: str) -> None:
    backends = [ZooKeeperBackend(url), _second_client(url)]
    tokens = []
    for n in range(20):
        with backends[n % 2].acquire("fence", wait=5) as lease:
            tokens.append(lease.token)
            assert backends[(n + 1) % 2].holder("fence").fence == lease.token  # type: ignore[union-attr]
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)


@needs_zk
def test_holder_identity_is_readable_by_another_client(url: str) -> None:
    backend = ZooKeeperBackend(url)
    with backend.acquire("who", holder="task-42") as lease:
        holder = _second_client(url).holder("who")
        info = _second_client(url).inspect("who")
        listed = _second_client(url).locks("wh")
    assert holder is not None
    assert (holder.task_id, holder.pid, holder.fence) == ("task-42", os.getpid(), lease.token)
    assert info.held
    assert info.task_id == "task-42"
    assert info.fence == lease.token
    assert [i.key for i in listed] == ["who"]


@needs_zk
def test_a_forced_release_is_noticed_by_the_holder_and_admits_the_next(url: str) -> None:
    backend = ZooKeeperBackend(url)
    operator = _second_client(url)
    told: list[LockLost] = []
    lease = backend.acquire("forced", holder="task-1", on_lost=lambda _lease, err: told.append(err))
    got: list[Lease] = []
    waiter = threading.Thread(target=lambda: got.append(operator.acquire("forced", wait=30)))
    waiter.start()
    until(lambda: len(operator.queue("forced")) == 2, 10, "the waiter queued")
    holder = operator.holder("forced")
    assert holder is not None
    assert operator.force_release("forced", holder)
    until(lambda: bool(told), 10, "the holder to notice")  # on_lost ran
    assert lease.lost
    assert "deleted by another client" in told[0].reason
    with pytest.raises(LockLost):
        lease.ensure()
    waiter.join(10)
    assert got
    assert got[0].token > lease.token
    got[0].release()
    lease.release()


@needs_zk
def test_a_forced_release_of_an_uncontended_key_is_noticed(url: str) -> None:
    """No waiter ever changed the key's children: the holder still hears of the delete."""
    backend = ZooKeeperBackend(url)
    lease = backend.acquire("alone", holder="task-1")
    operator = _second_client(url)
    holder = operator.holder("alone")
    assert holder is not None
    assert operator.release_nonce("alone", holder.nonce)
    until(lambda: lease.lost, 10, "the holder to notice")
    assert "deleted by another client" in (lease.lost_reason or "")
    lease.release()


@needs_zk
def test_operator_calls_check_endpoints_purge_and_release_by_task(url: str, zk: ZkServer) -> None:
    backend = ZooKeeperBackend(url)
    assert backend.check() == [(backend.endpoints()[0], None)]
    assert backend.endpoints()[0].startswith(f"zookeeper://{zk.hosts}/t-")
    a = backend.acquire("jobs:a", holder="task-a")
    b = backend.acquire("jobs:b", holder="task-b")
    other = backend.acquire("other", holder="task-c")
    assert not backend.release_by_task("jobs:a", "task-x")
    assert backend.release_by_task("jobs:a", "task-a")
    until(lambda: a.lost, 10, "the holder of jobs:a to notice")
    assert backend.purge("jobs:") == ["jobs:b"]
    until(lambda: b.lost, 10, "the holder of jobs:b to notice")
    assert backend.holder("other") is not None
    for lease in (a, b, other):
        lease.release()


@needs_zk
def test_check_names_a_server_that_does_not_answer(zk: ZkServer) -> None:
    dead = ZooKeeperBackend(f"zookeeper://{zk.hosts},127.0.0.1:1/t")
    checked = dict(dead.check())
    assert checked[dead.endpoints()[0]] is None
    assert checked[dead.endpoints()[1]]  # connection refused, said


@needs_zk
def test_a_forgotten_lease_keeps_its_key_for_its_ttl(url: str) -> None:
    """forget() (beat's tick keys): no release now; the node is deleted once the ttl is up."""
    backend = ZooKeeperBackend(url)
    lease = backend.acquire("tick", ttl=0.6, holder="beat")
    backend.forget(lease)
    forgotten = time.monotonic()
    with pytest.raises(LockContended):
        _second_client(url).acquire("tick")
    until(lambda: backend.holder("tick") is None, 10, "the node deleted")
    assert time.monotonic() - forgotten >= 0.5


@needs_zk
def test_lock_on_a_zookeeper_url_runs_on_this_backend(url: str) -> None:
    """celery_dlock.lock() with a zookeeper:// URL: the registry makes this backend."""
    with lock([url], "via-lock", wait=5, holder="task-l") as lease:
        assert isinstance(lease, ZkLease)
        holder = _second_client(url).holder("via-lock")
        assert holder is not None
        assert holder.task_id == "task-l"
        with pytest.raises(LockContended):
            lock([url], "via-lock").__enter__()
    assert _second_client(url).holder("via-lock") is None


@needs_zk
def test_release_is_idempotent_and_frees_the_key(url: str) -> None:
    backend = ZooKeeperBackend(url)
    lease = backend.acquire("idem")
    assert lease.release() is True
    assert lease.release() is False
    assert backend.holder("idem") is None


@needs_zk
def test_acquire_takes_no_renew_interval_nor_fence_retention_the_session_paces_renewal(
    url: str,
) -> None:
    """The shared argument checks (BaseBackend.acquire) take neither here: a session lease is
    confirmed at the session's pace whatever ``renew_interval`` says (even one no ttl would
    allow), and a free key keeps no fence counter to retain."""
    backend = ZooKeeperBackend(url, ttl=3.0)
    lease = backend.acquire("paced", renew_interval=60.0, fence_retention=0.001)
    try:
        session = backend.shared
        assert lease.renew_interval == renew_every(min(session.negotiated, 3.0))
    finally:
        assert lease.release() is True
    with pytest.raises(ConfigError, match="ttl"):
        backend.acquire("paced", ttl=-1)


@needs_zk
def test_session_expiry_ends_the_lease_before_another_client_gets_the_key(zk: ZkServer) -> None:
    chroot = f"t-{uuid.uuid4().hex[:8]}"
    with FaultProxy(zk.client_port) as proxy:
        cut_off = ZooKeeperBackend(f"zookeeper://127.0.0.1:{proxy.port}/{chroot}?timeout=2")
        direct = ZooKeeperBackend(f"zookeeper://{zk.hosts}/{chroot}?timeout=4")
        lost_at: list[float] = []
        lease = cut_off.acquire(
            "part", on_lost=lambda _lease, _err: lost_at.append(time.monotonic())
        )
        got_at: list[float] = []

        def take() -> None:
            with direct.acquire("part", wait=30):
                got_at.append(time.monotonic())

        waiter = threading.Thread(target=take)
        waiter.start()
        until(lambda: len(direct.queue("part")) == 2, 10, "the waiter queued")
        proxy.blackhole()
        until(lambda: lease.suspended_until is not None, 10, "the holder's connection suspended")
        assert lease.valid_for <= 2 / 3  # at most a third of the session timeout
        until(lambda: bool(got_at), 20, "the waiter to get the key")
        waiter.join(10)
        proxy.heal()
        assert lost_at
        assert lost_at[0] < got_at[0]
        # whichever bound ran out first: the suspended connection's cut, or the last
        # answered request's session timeout
        assert "session" in (lease.lost_reason or "")
        lease.release()
        close_all()


@needs_zk
def test_a_short_disconnection_keeps_the_lease(zk: ZkServer) -> None:
    with FaultProxy(zk.client_port) as proxy:
        backend = ZooKeeperBackend(f"zookeeper://127.0.0.1:{proxy.port}/t?timeout=6")
        lease = backend.acquire("blip")
        proxy.blackhole()
        until(lambda: lease.suspended_until is not None, 10, "the connection suspended")
        proxy.heal()
        until(lambda: lease.suspended_until is None, 10, "the session back")
        assert not lease.lost
        lease.ensure()
        lease.release()
        close_all()


@needs_zk
def test_a_held_lease_stays_valid_past_the_session_timeout(url: str) -> None:
    """The watchdog confirms the session (one exists per lease) every third of its timeout."""
    backend = ZooKeeperBackend(url.replace("timeout=4", "timeout=1"))
    with backend.acquire("long") as lease:
        assert 0 < lease.valid_for <= 1.0
        until(lambda: lease.renewals >= 4, 10, "four renewals")
        assert not lease.lost
        assert lease.valid_for > 0.3
        lease.ensure()


@needs_zk
def test_a_waiter_admitted_after_a_long_wait_gets_a_valid_lease(url: str) -> None:
    """Its validity counts from a request answered at admission, not from its queueing."""
    holder = _second_client(url)
    waiter = ZooKeeperBackend(url.replace("timeout=4", "timeout=1"))
    first = holder.acquire("long-wait")
    got: list[Lease] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire("long-wait", wait=30)))
    thread.start()
    until(partial(queued, holder, "long-wait", 2), 10, "the waiter queued")
    time.sleep(1.5)  # not a synchronisation: the point is to wait past the session timeout
    first.release()
    thread.join(10)
    assert got
    assert not got[0].lost
    assert got[0].valid_for > 0.5
    got[0].release()


def _paused_holder(url: str, conn: Any) -> None:
    """In a forked child: take the key, report, get stopped; then say what ensure() says."""
    backend = ZooKeeperBackend(url)
    lease = backend.acquire("paused")
    conn.send(("held", lease.token))
    conn.recv()  # sent after SIGCONT
    try:
        lease.ensure()
    except LockLost as exc:
        conn.send(("lost", exc.reason))
    else:
        conn.send(("held", lease.token))
    lease.release()
    close_all()


@needs_zk
def test_a_holder_paused_past_its_session_finds_its_lease_invalid(url: str) -> None:
    """A process stopped (SIGSTOP) while another client takes the key must not act on wake."""
    short = url.replace("timeout=4", "timeout=1")
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_paused_holder, args=(short, child))
    proc.start()
    assert proc.pid is not None
    pid = proc.pid
    try:
        assert parent.poll(20)
        _, token = parent.recv()
        os.kill(pid, signal.SIGSTOP)
        other = ZooKeeperBackend(url)
        with other.acquire("paused", wait=30) as next_lease:  # the child's session expired
            assert next_lease.token > token
            os.kill(pid, signal.SIGCONT)
            parent.send("go")
            assert parent.poll(20)
            state, reason = parent.recv()
        assert state == "lost"
        assert "session" in reason
    finally:
        os.kill(pid, signal.SIGCONT)
        proc.join(20)


@needs_zk
def test_max_hold_ends_the_lease(url: str) -> None:
    backend = ZooKeeperBackend(url)
    told: list[LockLost] = []
    lease = backend.acquire("max", max_hold=0.3, on_lost=lambda _l, err: told.append(err))
    until(lambda: bool(told), 5, "the watchdog to report max_hold")
    assert "max_hold" in told[0].reason
    lease.release()


# -- a three-node ensemble ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ens() -> Iterator[Ensemble]:
    if REASON is not None:
        pytest.skip(REASON)
    with ensemble(3) as group:
        yield group


@pytest.fixture
def ens_url(ens: Ensemble) -> Iterator[str]:
    for server in ens.servers:  # a test before may have stopped one
        if not server.running:
            server.start()
    for server in ens.servers:
        server.wait_serving()
    yield f"zookeeper://{ens.hosts}/e-{uuid.uuid4().hex[:8]}?timeout=6"
    close_all()


@needs_zk
@pytest.mark.slow
def test_leader_killed_no_two_holders_and_tokens_still_increase(
    ens: Ensemble, ens_url: str
) -> None:
    a, b = ZooKeeperBackend(ens_url), _second_client(ens_url.replace("timeout=6", "timeout=4"))
    lease = a.acquire("lead")
    got: list[Lease] = []
    waiter = threading.Thread(target=lambda: got.append(b.acquire("lead", wait=60)))
    waiter.start()
    until(lambda: len(a.queue("lead")) == 2, 10, "the waiter queued")
    ens.leader().stop(kill=True)
    new_leader = ens.leader()
    assert new_leader.running
    until(lambda: a.holder("lead") is not None, 20, "the ensemble serving again")
    assert not got  # the holder's node survived the election: nobody else holds it
    assert not lease.lost
    lease.release()
    waiter.join(30)
    assert got
    assert got[0].token > lease.token
    got[0].release()
    with a.acquire("lead") as after:  # a node created under the new leader
        assert after.token > got[0].token


@needs_zk
@pytest.mark.slow
def test_waiters_keep_their_order_through_a_leader_change(ens: Ensemble, ens_url: str) -> None:
    backend = ZooKeeperBackend(ens_url)
    watcher = _second_client(ens_url)
    first = backend.acquire("order")
    admitted: list[int] = []
    inside = 0
    overlaps = 0
    guard = threading.Lock()

    def wait_turn(n: int) -> None:
        nonlocal inside, overlaps
        with backend.acquire("order", wait=60):
            with guard:
                inside += 1
                overlaps += inside > 1
                admitted.append(n)
            with guard:
                inside -= 1

    threads = []
    for n in range(4):
        thread = threading.Thread(target=wait_turn, args=(n,))
        thread.start()
        threads.append(thread)
        until(partial(queued, watcher, "order", n + 2), 10, f"waiter {n} queued")
    ens.leader().stop(kill=True)
    ens.leader()  # a new one elected
    assert not first.lost
    first.release()
    for thread in threads:
        thread.join(60)
    assert admitted == [0, 1, 2, 3]
    assert overlaps == 0


@needs_zk
@pytest.mark.slow
def test_a_minority_stopped_locks_still_work(ens: Ensemble, ens_url: str) -> None:
    follower = next(s for s in ens.servers if s.mode() == "follower")
    follower.stop()
    backend = ZooKeeperBackend(ens_url)
    tokens = []
    for _ in range(5):
        with backend.acquire("minority") as lease:
            tokens.append(lease.token)
    assert tokens == sorted(set(tokens))


@needs_zk
@pytest.mark.slow
def test_a_restarted_server_keeps_order_and_holders(ens: Ensemble, ens_url: str) -> None:
    backend = ZooKeeperBackend(ens_url)
    lease = backend.acquire("restart", holder="task-r")
    for server in ens.servers:
        server.restart()  # one at a time: a quorum is up throughout
    holder = _second_client(ens_url).holder("restart")
    assert holder is not None
    assert holder.fence == lease.token
    assert not lease.lost
    lease.release()
    with backend.acquire("restart") as again:
        assert again.token > lease.token


@needs_zk
@pytest.mark.slow
def test_partitioned_holder_on_an_ensemble_loses_before_the_next_gets_it(ens: Ensemble) -> None:
    chroot = f"e-{uuid.uuid4().hex[:8]}"
    target = ens.servers[0]
    with FaultProxy(target.client_port) as proxy:
        cut_off = ZooKeeperBackend(f"zookeeper://127.0.0.1:{proxy.port}/{chroot}?timeout=3")
        others = ",".join(s.hosts for s in ens.servers[1:])
        direct = ZooKeeperBackend(f"zookeeper://{others}/{chroot}?timeout=6")
        lost_at: list[float] = []
        lease = cut_off.acquire("p", on_lost=lambda _l, _e: lost_at.append(time.monotonic()))
        got_at: list[float] = []

        def take() -> None:
            with direct.acquire("p", wait=30):
                got_at.append(time.monotonic())

        waiter = threading.Thread(target=take)
        waiter.start()
        until(lambda: len(direct.queue("p")) == 2, 10, "the waiter queued")
        proxy.blackhole()
        until(lambda: bool(got_at), 30, "the waiter to get the key")
        waiter.join(10)
        proxy.heal()
        assert lost_at
        assert lost_at[0] < got_at[0]
        lease.release()
        close_all()


@needs_zk
def test_a_holder_whose_listing_crossed_a_waiters_removal_of_the_watch_hears_of_a_forced_release(
    zk: ZkServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two acquisitions of one process, one session: B's create goes first, then A's create
    and listing, then B's listing (a thread switch between B's two requests), then A, waiting
    behind B, takes back the key's children watch (``removeWatches``). The servers keep one
    such watch per session and path, so the removal also takes the one B's listing set; B,
    first in line at once, relies on that watch to hear that its node was deleted. Replies
    are delayed by a relay so that B's listing is answered after A's removal went out, as a
    busy process may see. A forced release of B's node must still be noticed."""
    from celery_dlock.backends.zookeeper.entry import Attempt

    chroot = f"t-{uuid.uuid4().hex[:8]}"
    delay = 0.5
    with FaultProxy(zk.client_port) as proxy:
        backend = ZooKeeperBackend(f"zookeeper://127.0.0.1:{proxy.port}/{chroot}?timeout=12")
        operator = ZooKeeperBackend(f"zookeeper://{zk.hosts}/{chroot}?timeout=10")
        operator.acquire("race").release()  # the key's parent exists (one create, one list)
        send = Attempt.send
        b_created, b_may_list = threading.Event(), threading.Event()

        def send_with_a_thread_switch(self: Attempt) -> None:
            if self.holder != "B":
                send(self)
                return
            self.created = self.client.create_async(
                f"{self.parent}/{self.name_prefix}",
                self.data,
                acl=self.session.acl,
                ephemeral=True,
                sequence=True,
                include_data=True,
            )
            b_created.set()
            b_may_list.wait(30)
            self.listing = self.client.get_children_async(
                self.parent, watch=self.guard.on_children, include_data=True
            )

        monkeypatch.setattr(Attempt, "send", send_with_a_thread_switch)
        backend.shared.start()
        proxy.delay(delay)
        got: dict[str, Lease] = {}
        b = threading.Thread(target=lambda: got.update(B=backend.acquire("race", holder="B")))
        b.start()
        assert b_created.wait(30)
        until(lambda: len(operator.queue("race")) == 1, 10, "B's node made")
        a = threading.Thread(
            target=lambda: got.update(A=backend.acquire("race", holder="A", wait=60))
        )
        a.start()
        until(lambda: len(operator.queue("race")) == 2, 10, "A's node made")
        # B's listing goes out after A's (A's went with its create) and well before A's reply
        # is let through (``delay`` after it was sent), after which A sends its removal:
        # the middle of that window, which the relay's delay sets.
        time.sleep(delay / 2)
        b_may_list.set()
        try:
            until(lambda: "B" in got, 10 + 4 * delay, "B to hold the key")
            proxy.heal()
            lease = got["B"]
            until(lambda: len(operator.queue("race")) == 2, 10, "A waiting")
            holder = operator.holder("race")
            assert holder is not None
            assert holder.task_id == "B"
            assert operator.release_nonce("race", holder.nonce)  # A is admitted
            until(lambda: "A" in got, 10, "A to hold the key")
            until(lambda: lease.lost, 10, "B to notice that its node was deleted")
        finally:
            b_may_list.set()
            proxy.heal()
            a.join(30)
            b.join(30)
            for held in got.values():
                held.release()
    close_all()


@needs_zk
def test_an_acquisition_whose_replies_were_held_longer_than_its_ttl_gets_a_valid_lease(
    zk: ZkServer,
) -> None:
    """The servers answer the create and the listing only after a pause longer than the ttl
    (a leader election, a server's GC pause, a congested link): the session lease's validity,
    counted from the create's send and capped by the ttl, would be over on arrival. The
    acquisition proves the session afresh instead of handing its caller a lease already
    lost (before: lost at once, 'no ZooKeeper server answered ...', and a body run under it)."""
    chroot = f"t-{uuid.uuid4().hex[:8]}"
    ttl, pause = 1.0, 1.5
    with FaultProxy(zk.client_port) as proxy:
        backend = ZooKeeperBackend(f"zookeeper://127.0.0.1:{proxy.port}/{chroot}?timeout=12")
        backend.acquire("held-up", ttl=ttl).release()  # the session and the key's parent exist
        client = backend.shared.start()
        proxy.blackhole()
        got: list[Lease] = []
        taker = threading.Thread(target=lambda: got.append(backend.acquire("held-up", ttl=ttl)))
        taker.start()
        try:
            until(lambda: len(client._pending) > 0, 10, "the create sent")
            time.sleep(pause)  # the pause the servers' replies are held for (> ttl)
        finally:
            proxy.heal()
            taker.join(10)
        assert got
        lease = got[0]
        try:
            assert not lease.lost, lease.lost_reason
            assert lease.valid_for > ttl / 2
        finally:
            lease.release()
    close_all()
