"""The lock core under faults: stalled nodes, interrupted calls, stale counters, busy pools."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
from celery import Celery

from celery_dlock import LockContended, LockLost, LockUnavailable, lock
from celery_dlock.backends.redis import scripts
from celery_dlock.celery import interrupt
from celery_dlock.core.lease import Lease
from celery_dlock.core.registry import manager_for
from celery_dlock.testing import RedisServer, redis_servers
from tests.support.clients import client

pytestmark = pytest.mark.local_redis


def app_for(urls: list[str], **conf: Any) -> Celery:
    app = Celery("test", set_as_current=False)
    app.conf.dlock_urls = urls
    app.conf.update(conf)
    return app


class Interrupted(Exception):
    """Raised into the main thread by a timer, like a soft time limit."""


@contextmanager
def interrupt_after(seconds: float) -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def interrupt_when(condition: Callable[[], bool], timeout: float = 10) -> Iterator[None]:
    """Raise :class:`Interrupted` into the main thread (a signal, like a soft time limit) as
    soon as ``condition()`` holds, watched from a thread: the interrupt lands in the state
    the test names, however late a loaded machine runs the call under test."""

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted

    main = threading.main_thread().ident
    assert main is not None
    assert threading.get_ident() == main, "a signal's handler runs in the main thread"
    done = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while not done.is_set() and time.monotonic() < deadline:
            if condition():
                signal.pthread_kill(main, signal.SIGALRM)
                return
            done.wait(0.005)

    previous = signal.signal(signal.SIGALRM, handler)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGALRM, previous)


def test_interrupted_call_never_leaves_a_reply_for_the_next_command(
    servers: list[RedisServer],
) -> None:
    """An exception mid-call (soft time limit) must not let the next command read the old
    reply: here the old reply would say "acquired" for a key someone else holds."""
    urls = [s.url for s in servers[:3]]
    app = app_for(urls, dlock_node_timeout=2.0)
    manager = manager_for(app)
    other = manager.acquire("k2", ttl=30, renew=False)  # B holds k2 everywhere
    servers[1].pause()
    # Interrupted once nodes 0 and 2 have taken k1 (so node 1 was sent it too, and is all
    # the call still waits for), not at a fixed time: a timer could fire before the call got
    # that far on a starved CI process, or after its wait for node 1 ran out.
    taken = [client(url) for url in (urls[0], urls[2])]
    with (
        pytest.raises(Interrupted),
        interrupt_when(lambda: all(c.exists("dlock:{k1}") for c in taken)),
    ):
        manager.acquire("k1", ttl=30, renew=False)  # node 1 stalls; we are interrupted
    servers[1].resume()
    with pytest.raises(LockContended):
        manager.acquire("k2", ttl=30, renew=False)
    # The interrupted attempt is undone in the background, on every node, soon.
    deadline = time.monotonic() + 5
    while any(client(u).exists("dlock:{k1}") for u in urls):
        assert time.monotonic() < deadline, "the interrupted attempt was never undone"
        time.sleep(0.05)
    other.release()


def _in_handshake(conn: Any) -> bool:
    """True while some thread waits inside redis-py's handshake (``on_connect``: AUTH,
    SELECT) for the server's reply on ``conn``."""
    for frame in sys._current_frames().values():
        outer: FrameType | None = frame
        reading = False
        while outer is not None:
            if outer.f_code.co_name == "read_response" and outer.f_locals.get("self") is conn:
                reading = True
            elif reading and outer.f_code.co_name.startswith("on_connect"):
                return True
            outer = outer.f_back
    return False


def test_a_call_interrupted_while_connecting_never_shares_the_connection_being_set_up() -> None:
    """A soft time limit landing while a fan-out's connects run in the background must not
    leave the thread that connection: its next call would write beside the handshake, here
    after an AUTH whose SELECT had not gone out yet, so its acquire ran in database 0."""
    with redis_servers(3, extra_args=["--requirepass", "pw"]) as servers:
        urls = [f"redis://:pw@127.0.0.1:{s.port}/1" for s in servers]
        manager = manager_for(app_for(urls, dlock_node_timeout=2.0))
        # The scripts cached on every server, by a client of our own: the manager's
        # connections stay unopened (a thread's would pass to this one when it ended), so
        # the call below connects all three in the background.
        for url in urls:
            for source in scripts.ALL.values():
                client(url).script_load(source)
        conns = [node.connection() for node in manager.nodes]
        servers[1].pause()  # its TCP connect succeeds; AUTH waits for a reply
        try:
            with (
                pytest.raises(Interrupted),
                interrupt_when(lambda: _in_handshake(conns[1])),
            ):
                manager.acquire("k1", ttl=30, renew=False)
            # The next call, on the same thread, while that handshake still waits; node 1
            # answers once the call has written to the others.
            taken = [client(urls[0]), client(urls[2])]
            resumer = threading.Thread(
                target=until_then,
                args=(lambda: all(c.exists("dlock:{k2}") for c in taken), servers[1].resume),
            )
            resumer.start()
            lease = manager.acquire("k2", ttl=30, renew=False)
            resumer.join()
        finally:
            servers[1].resume()
        db0 = client(f"redis://:pw@127.0.0.1:{servers[1].port}/0")
        db0.ping()  # served after whatever the paused server had already been sent
        assert db0.keys("dlock:*") == [], "a lock command ran before the handshake's SELECT"
        lease.release()


def until_then(
    condition: Callable[[], bool], then: Callable[[], None], timeout: float = 10
) -> None:
    """Call ``then()`` once ``condition()`` holds (polled), or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    then()


def test_many_failed_attempts_with_nodes_down_do_not_stall_renewal(
    servers: list[RedisServer],
) -> None:
    app = app_for([s.url for s in servers], dlock_node_timeout=0.2)
    lease = lock(app, "alive", ttl=1.0).acquire()
    blocker = lock(app, "busy", ttl=30).acquire()
    for server in servers[:2]:
        server.pause()

    def contender() -> None:
        with pytest.raises(LockContended):
            lock(app, "busy", ttl=30).acquire()

    threads = [threading.Thread(target=contender) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    renewals = lease.renewals
    end = time.monotonic() + 2.0
    while time.monotonic() < end:  # the time under test: two seconds of ttl-1 renewals
        time.sleep(0.1)
    assert not lease.lost
    assert lease.renewals >= renewals + 4
    for server in servers[:2]:
        server.resume()
    lease.release()
    blocker.release()


def test_single_redis_tokens_rise_past_a_counter_restored_from_an_old_snapshot(
    server: RedisServer,
) -> None:
    manager = manager_for([server.url])
    first = manager.acquire("snap", ttl=5, renew=False)
    first.release()
    second = manager.acquire("snap", ttl=5, renew=False)
    second.release()
    # An older snapshot comes back: the counter is behind the tokens already issued.
    client(server.url).set("dlock:{snap}:fence", first.token)
    third = manager.acquire("snap", ttl=5, renew=False)
    assert third.token > second.token
    third.release()


def test_an_acquire_that_timed_out_is_undone_once_the_node_answers(server: RedisServer) -> None:
    app = app_for([server.url], dlock_node_timeout=0.2)
    manager_for(app).acquire("warm", ttl=5, renew=False).release()
    server.pause()
    with pytest.raises(LockUnavailable):
        lock(app, "phantom", ttl=30).acquire()
    time.sleep(0.6)  # the stall being simulated, longer than the node timeout
    server.resume()
    raw = client(server.url)
    deadline = time.monotonic() + 5
    while raw.exists("dlock:{phantom}"):
        assert time.monotonic() < deadline, "a phantom lock stayed for the whole ttl"
        time.sleep(0.05)
    with lock(app, "phantom", ttl=30):
        pass


def test_waiters_are_woken_when_the_first_node_is_stalled(servers: list[RedisServer]) -> None:
    app = app_for([s.url for s in servers], dlock_node_timeout=0.2)
    holder = lock(app, "stall", ttl=30).acquire()
    servers[0].pause()
    got: list[float] = []

    def waiter() -> None:
        with lock(app, "stall", ttl=30, wait=10):
            got.append(time.monotonic())

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)  # let the waiter block (pacing: the assertion below needs no ordering)
    released = time.monotonic()
    holder.release()
    thread.join(timeout=10)
    servers[0].resume()
    assert got, "the waiter never got the lock"
    assert got[0] - released < 1.0

    started = time.monotonic()
    with lock(app, "stall", ttl=30):
        servers[0].pause()
        with pytest.raises(LockContended), lock(app, "stall", ttl=30, wait=1.5):
            pass
        servers[0].resume()
    assert time.monotonic() - started < 1.5 + 1.0, "the wait bound was overrun"


def test_an_interrupted_waiter_does_not_swallow_the_next_wake_up(
    single_urls: list[str],
) -> None:
    holder = lock(single_urls, "swallow", ttl=30).acquire()
    with pytest.raises(Interrupted), interrupt_after(0.2):
        lock(single_urls, "swallow", ttl=30, wait=10).acquire()
    got: list[Lease] = []

    def waiter() -> None:
        got.append(lock(single_urls, "swallow", ttl=30, wait=10).acquire())

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)  # let the second waiter block
    released = time.monotonic()
    holder.release()
    thread.join(timeout=10)
    assert got, "no waiter got the lock"
    assert got[0].acquired_at - released < 0.5
    got[0].release()


def test_contention_and_inspection_report_the_real_token_when_counters_differ(
    redlock_urls: list[str],
) -> None:
    for i, url in enumerate(redlock_urls):
        client(url).set("dlock:{differ}:fence", 100 * (i + 1))
    manager = manager_for(redlock_urls)
    lease = manager.acquire("differ", ttl=10, renew=False)
    assert lease.token == 501
    with pytest.raises(LockContended) as info:
        manager.acquire("differ", ttl=10, renew=False)
    assert info.value.holder is not None
    assert info.value.holder.fence == 501
    held = manager.holder("differ")
    assert held is not None
    assert held.fence == 501
    lease.release()
    assert manager.holder("differ") is None


def test_a_minority_holder_is_never_named_as_the_holder(redlock_urls: list[str]) -> None:
    """Partial values of collided contenders (two on two nodes each) are not a holder: a
    caller is told the key is contended, never that one of them holds it."""
    values = [b'{"token":"a","holder":"ghost-a","host":"h","pid":1,"since":0,"fence":1}'] * 2
    values += [b'{"token":"b","holder":"ghost-b","host":"h","pid":1,"since":0,"fence":2}'] * 2
    for url, value in zip(redlock_urls, values, strict=False):
        client(url).set("dlock:{ghosts}", value, px=10_000)
    with pytest.raises(LockContended) as info:
        lock(redlock_urls, "ghosts", ttl=5).acquire()
    assert info.value.holder is None
    assert "no majority" in str(info.value)


def _expired_lease(urls: list[str]) -> Lease:
    """A lease whose validity has run out on the monotonic clock, nobody having noticed."""
    lease = manager_for(urls).acquire("told", ttl=0.05, renew=False)
    deadline = time.monotonic() + 2
    while lease.valid_for > 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return lease


def _handle_loss(lease: Lease, watchdog_interrupts: Any) -> str:
    """A body that checks its lease, and handles the LockLost it gets; the watchdog's
    interrupt for the same loss arrives while it is handling it (the race a paused worker
    process resumed into: body and watchdog notice at once)."""
    try:
        lease.ensure()
    except LockLost:
        watchdog_interrupts()
        total = 0
        for i in range(200_000):  # bytecodes enough for a pending interrupt to land
            total += i
        return "handled"
    return "not lost"


def test_a_body_told_by_ensure_is_not_interrupted_again_main_thread(single_urls: list[str]) -> None:
    lease = _expired_lease(single_urls)
    run = interrupt.start()
    run.lease = lease
    try:
        # From another thread, as the watchdog does; joined, so the signal is already sent.
        def from_watchdog() -> None:
            t = threading.Thread(target=interrupt.interrupt, args=(run,))
            t.start()
            t.join()

        assert _handle_loss(lease, from_watchdog) == "handled"
    finally:
        interrupt.stop(run)
        lease.release()


def test_a_body_told_by_ensure_is_not_interrupted_again_other_thread(
    single_urls: list[str],
) -> None:
    lease = _expired_lease(single_urls)
    outcome: list[Any] = []

    def body() -> None:
        run = interrupt.start()
        run.lease = lease
        try:
            outcome.append(_handle_loss(lease, lambda: interrupt.interrupt(run)))
        except BaseException as exc:
            outcome.append(exc)
        finally:
            interrupt.stop(run)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10)
    lease.release()
    assert outcome == ["handled"]


def test_an_unaware_body_is_still_interrupted(single_urls: list[str]) -> None:
    """The other side of the same rule: a body that has not called ensure() is stopped."""
    lease = manager_for(single_urls).acquire("told", ttl=30, renew=False)
    run = interrupt.start()
    run.lease = lease
    try:
        with pytest.raises(LockLost):
            threading.Thread(target=interrupt.interrupt, args=(run,)).start()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        interrupt.stop(run)
        lease.release()
