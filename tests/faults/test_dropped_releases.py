"""Regression tests for the Redis-side seams: releases written into connections the server has
closed, phantoms left by a node that hung through an acquisition, losses of leases that are
not renewed, and cool-downs that outlast the failures behind them."""

from __future__ import annotations

import gc
import sys
import threading
import time
from typing import Any

import pytest
from celery import Celery

from celery_dlock import LockContended, LockLost, LockUnavailable, lock, lock_lost
from celery_dlock.core.lease import Lease
from celery_dlock.core.registry import manager_for
from celery_dlock.testing import RedisServer
from tests.support.clients import client, idle_timeout
from tests.support.proxy import FaultProxy

pytestmark = pytest.mark.local_redis


def app_for(urls: list[str], **conf: Any) -> Celery:
    app = Celery("test", set_as_current=False)
    app.conf.dlock_urls = urls
    app.conf.update(conf)
    return app


def wait_gone(url: str, key: str, timeout: float) -> float:
    """Seconds until ``key``'s lock is gone from ``url``; fails after ``timeout``."""
    begun = time.monotonic()
    raw = client(url)
    while raw.exists(f"dlock:{{{key}}}"):
        left = raw.pttl(f"dlock:{{{key}}}")
        assert time.monotonic() - begun < timeout, f"{key} still held ({left} ms to live)"
        time.sleep(0.01)
    return time.monotonic() - begun


# -- 1. a reply-less release into a connection the server has closed ------------------------


@pytest.mark.parametrize("how", ["idle-timeout", "client-kill"])
def test_release_without_waiting_after_the_server_closed_the_connection(
    server: RedisServer, how: str
) -> None:
    """The task thread's connection idles through the body; the server closes it (its
    ``timeout`` setting, or ``CLIENT KILL``). The end-of-task release must still free the key
    at once, not leave it for the ttl."""
    raw = client(server.url)
    lease = lock([server.url], f"closed-{how}", ttl=30, renew_interval=0.3).acquire()
    if how == "idle-timeout":
        raw.config_set("timeout", 1)
        try:
            # The body runs 2.5 s; renewals (the watchdog's connection) keep the lease alive.
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            idle_timeout(server.url, 0)
    else:
        raw.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    assert not lease.lost
    lease.release(wait=False)
    assert wait_gone(server.url, f"closed-{how}", 0.5) < 0.5


def test_a_release_the_server_drops_as_it_closes_is_sent_again_before_the_next_command(
    server: RedisServer,
) -> None:
    """The close races the write: the release leaves into a socket that looked alive and is
    dropped with it. The next command on that connection (the next task's acquire of the same
    key) must find the key free: the release goes out again first."""
    with FaultProxy(server.port) as proxy:
        manager = manager_for([proxy.url])
        manager.acquire("raced", ttl=30, renew=False).release(wait=False)  # skip probe done
        lease = manager.acquire("raced", ttl=30, renew=False)
        proxy.swallow()
        lease.release(wait=False)
        assert proxy.swallowed.wait(5), "the proxy never saw the release"
        proxy.heal()
        again = manager.acquire("raced", ttl=30, renew=False)  # LockContended if it was lost
        assert again.token > lease.token
        again.release()


def test_a_release_the_server_drops_as_it_closes_is_sent_again_by_the_janitor(
    server: RedisServer,
) -> None:
    """The same race on a thread that does not use its connection again: the janitor finds
    the release unconfirmed after the grace period and sends it itself."""
    with FaultProxy(server.port) as proxy:
        manager = manager_for([proxy.url])
        manager.acquire("raced-idle", ttl=30, renew=False).release(wait=False)
        lease = manager.acquire("raced-idle", ttl=30, renew=False)
        proxy.swallow()
        lease.release(wait=False)
        assert proxy.swallowed.wait(5), "the proxy never saw the release"
        proxy.heal()
        # Within resends.CONFIRM_GRACE (1 s) + janitor.SWEEP_TICK (0.5 s), a round trip,
        # and slack for a loaded machine.
        wait_gone(server.url, "raced-idle", 3.5)


def test_a_dropped_release_of_a_thread_that_ends_is_sent_again_by_the_janitor(
    server: RedisServer,
) -> None:
    """The same race in a thread that ends right after the release: its connections close
    with it, and the release they could no longer confirm goes to the janitor."""
    with FaultProxy(server.port) as proxy:
        manager = manager_for([proxy.url])

        def task() -> None:
            manager.acquire("raced-thread", ttl=30, renew=False).release(wait=False)
            lease = manager.acquire("raced-thread", ttl=30, renew=False)
            proxy.swallow()
            lease.release(wait=False)
            assert proxy.swallowed.wait(5), "the proxy never saw the release"

        thread = threading.Thread(target=task)
        thread.start()
        thread.join(10)
        wait_gone(server.url, "raced-thread", 3.5)


def test_a_dropped_release_on_a_connection_the_thread_lets_go_of_is_sent_again(
    server: RedisServer,
) -> None:
    """The same race, and then the thread gives its connection up (a connect it stopped
    waiting for, ``connecting._give_up``): the release that connection could no longer confirm
    goes to the janitor, not away with the connection object."""
    with FaultProxy(server.port) as proxy:
        manager = manager_for([proxy.url])
        manager.acquire("raced-dropped", ttl=30, renew=False).release(wait=False)
        lease = manager.acquire("raced-dropped", ttl=30, renew=False)
        proxy.swallow()
        lease.release(wait=False)
        assert proxy.swallowed.wait(5), "the proxy never saw the release"
        proxy.heal()
        manager.nodes[0].drop_connection()
        gc.collect()  # the tracked set holds connections weakly: the object is gone now
        wait_gone(server.url, "raced-dropped", 3.5)


# -- 2. Redlock: a node that hung through a successful acquisition ---------------------------


def test_a_node_hung_through_an_acquisition_keeps_no_phantom_after_the_release(
    servers: list[RedisServer],
) -> None:
    """Node A hangs while an acquisition succeeds on B and C; the release cannot reach A.
    When A resumes it runs the queued acquire. Its delete is owed: with C then down (a
    minority), the key must be free again long before that phantom's ttl."""
    a, b, c = servers[:3]
    app = app_for([a.url, b.url, c.url], dlock_node_timeout=0.2)
    manager = manager_for(app)
    manager.acquire("hung", ttl=10, renew=False).release()  # connections made
    a.pause()
    lease = manager.acquire("hung", ttl=10, renew=False)  # A never answers
    lease.release()  # A: cooling down, or no answer again
    a.resume()
    c.kill()
    begun = time.monotonic()
    while True:
        try:
            again = manager.acquire("hung", ttl=10, renew=False)
            break
        except (LockContended, LockUnavailable) as exc:
            refused = exc
        waited = time.monotonic() - begun
        assert waited < 3.0, f"refused for {waited:.1f} s (ttl 10): {refused}"
        time.sleep(0.05)
    again.release()
    wait_gone(a.url, "hung", 2.0)


# -- 3. a lease that is not renewed still reports its loss -----------------------------------


def test_a_lease_that_is_not_renewed_reports_its_loss(single_urls: list[str]) -> None:
    """``renew=False, on_lost=cb``: the lease's validity runs out while held; ``cb`` runs once
    and ``lock_lost`` is sent, without anyone calling ``ensure()``."""
    called: list[tuple[float, LockLost]] = []
    signalled: list[str] = []
    told = threading.Event()

    def on_lost(lease: Lease, error: LockLost) -> None:
        called.append((time.monotonic(), error))
        told.set()

    def record(sender: Any = None, **kw: Any) -> None:
        signalled.append(kw["key"])

    lock_lost.connect(record, weak=False)
    try:
        lease = lock(single_urls, "unrenewed", ttl=0.5, renew=False, on_lost=on_lost).acquire()
        assert told.wait(3), "on_lost never ran"
        assert called[0][0] - lease.deadline < 0.3
        assert "not renewed" in called[0][1].reason
        with pytest.raises(LockLost):
            lease.ensure()
        lease.release()
        assert len(called) == 1
        assert signalled == ["unrenewed"]
    finally:
        lock_lost.disconnect(record)


# -- 4. cool-downs never leave fewer than a majority to try ----------------------------------


def test_two_nodes_failing_one_after_the_other_do_not_refuse_locks_once_back(
    servers: list[RedisServer],
) -> None:
    a, b, c = servers[:3]
    app = app_for([a.url, b.url, c.url], dlock_node_timeout=0.5)  # cool-down: 1 s
    manager = manager_for(app)
    manager.acquire("warm", ttl=5, renew=False).release()
    a.pause()
    manager.acquire("first", ttl=5, renew=False).release()  # A times out: cooling down
    a.resume()
    b.pause()
    with pytest.raises(LockUnavailable):  # A skipped, B times out: only C answers
        manager.acquire("second", ttl=5, renew=False)
    b.resume()
    assert all(node.down for node in manager.nodes[:2])
    with lock(app, "third", ttl=5) as lease:  # both back: tried although cooling down
        assert lease.token > 0
    assert not any(node.down for node in manager.nodes), "an answer ends the cool-down"


# -- the operator's reads with nodes that do not answer (found by the fault matrix) ------------


def test_holder_without_a_majority_is_unavailable_not_free(server: RedisServer) -> None:
    """``holder()`` used to answer "not held" when the node did not answer."""
    manager = manager_for(app_for([server.url], dlock_node_timeout=0.2))
    lease = manager.acquire("unseen", ttl=30, renew=False)
    server.pause()
    try:
        with pytest.raises(LockUnavailable):
            manager.holder("unseen")
    finally:
        server.resume()
    assert manager.holder("unseen") is not None
    lease.release()


def test_the_holders_token_is_shown_when_the_node_that_proposed_it_is_down(
    servers: list[RedisServer],
) -> None:
    """Each node's value carries its own counter; the token (the highest) lives on in the
    written-back counters when the node whose value carried it is down."""
    urls = [s.url for s in servers[:3]]
    for i, url in enumerate(urls):
        client(url).set("dlock:{shown}:fence", 100 * (3 - i))  # node 0 proposes the most
    manager = manager_for(app_for(urls, dlock_node_timeout=0.2))
    lease = manager.acquire("shown", ttl=30, renew=False)
    assert lease.token == 301
    servers[0].pause()
    try:
        holder = manager.holder("shown")
        info = manager.inspect("shown")
    finally:
        servers[0].resume()
    assert holder is not None
    assert holder.fence == lease.token
    assert info.holder is not None
    assert info.holder.fence == lease.token
    lease.release()


class _LatePoll:
    """``select.poll`` for :mod:`celery_dlock.backends.redis.transport` (its ``poller``), except
    that a poller built to read replies (in ``_exchange``, after the command went out and its
    deadline was set) stalls in ``register`` until the reply is there, then past the deadline:
    the calling thread descheduled by a busy host, or waiting for the GIL, when the answers
    come in."""

    overshoot = 0.1  # seconds past the reply: twice the node timeout of the test below

    def __init__(self) -> None:
        import select

        self._select = select
        self._poll = select.poll()
        self._late = sys._getframe(1).f_code.co_name == "_exchange"

    def register(self, fd: int, mask: int) -> None:
        if self._late:
            self._select.select([fd], [], [], 10)
            time.sleep(self.overshoot)
        self._poll.register(fd, mask)

    def unregister(self, fd: int) -> None:
        self._poll.unregister(fd)

    def poll(self, timeout: float | None = None) -> list[tuple[int, int]]:
        return self._poll.poll(timeout)


def test_replies_there_by_the_time_the_caller_looks_count_though_it_looks_late(
    redlock_urls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load, 60 publishers in one process often looked only after their deadline, and
    declared the nodes whose replies were waiting silent: the attempt failed (a duplicate was
    published without its queued lock), its writes voided, the nodes cooled down for all."""

    from celery_dlock.backends.redis import transport

    manager = manager_for(app_for(redlock_urls, dlock_node_timeout=0.05))
    manager.acquire("warm", ttl=5, renew=False).release()  # connections open, scripts known
    monkeypatch.setattr(transport, "poller", _LatePoll)
    lease = manager.acquire("late", ttl=30, renew=False)
    assert all(not node.down for node in manager.nodes)
    monkeypatch.undo()
    lease.release()
