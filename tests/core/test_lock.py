"""The lock core against real redis-server processes (and, for what users see of it, a real
ZooKeeper server): exclusion, waiting, renewal, loss, fencing."""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from celery import Celery, current_app

from celery_dlock import LockContended, LockLost, LockUnavailable, lock
from celery_dlock.core.lease import Lease
from celery_dlock.core.registry import forget, manager_for
from celery_dlock.core.renewal import watchdog
from celery_dlock.testing import RedisServer
from tests.support.clients import client

#: The ``urls`` fixture's stores this module runs on (tests/conftest.py).
MODES = ["single", "redlock5", "zookeeper"]


def on_zookeeper(urls: list[str]) -> bool:
    return urls[0].startswith("zookeeper://")


def delete_lock(urls: list[str], key: str) -> None:
    """Delete ``key``'s lock behind its holder's back: the Redis key on every node, or on
    ZooKeeper the holder's node (by a client of our own)."""
    if on_zookeeper(urls):
        from tests.support.zookeeper import delete_holder

        assert delete_holder(urls[0], key), f"nobody held {key!r}"
        return
    for url in urls:
        client(url).delete(f"dlock:{{{key}}}")


def gone(urls: list[str]) -> str:
    """How the loss reason words a deleted lock: Redis finds the key gone at the next
    renewal, ZooKeeper's watch on the holder's node sees it deleted."""
    return "node was deleted by another client" if on_zookeeper(urls) else "gone"


def app_for(urls: list[str], **conf: Any) -> Celery:
    app = Celery("test", set_as_current=False)
    app.conf.dlock_urls = urls
    app.conf.update(conf)
    return app


def lock_keys(urls: list[str], key: str) -> list[bytes | None]:
    """The raw lock value on each node (None where absent)."""
    return [client(url).get(f"dlock:{{{key}}}") for url in urls]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until true, failing the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


# -- mutual exclusion ------------------------------------------------------------------------


def test_mutual_exclusion_8_threads_x_200(urls: list[str]) -> None:
    inside = 0
    most = 0
    done = 0
    count_lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        nonlocal inside, most, done
        try:
            for _ in range(200):
                with lock(urls, "mutex", ttl=5, wait=None) as lease:
                    with count_lock:
                        inside += 1
                        most = max(most, inside)
                    lease.ensure()
                    time.sleep(0.0001)  # the critical section's "work": widens any overlap
                    with count_lock:
                        inside -= 1
                        done += 1
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=100)
    assert not errors
    assert done == 1600
    assert most == 1


# -- Redlock quorum and node failures ------------------------------------------------------


@pytest.mark.local_redis
@pytest.mark.parametrize("how", ["killed", "paused"])
def test_redlock_survives_two_of_five_down(servers: list[RedisServer], how: str) -> None:
    app = app_for([s.url for s in servers], dlock_node_timeout=0.2)
    for server in servers[:2]:
        server.kill() if how == "killed" else server.pause()
    with lock(app, "two-down", ttl=5) as lease:
        assert lease.valid_for > 4
        assert lease.token > 0
        live = lock_keys([s.url for s in servers[2:]], "two-down")
        assert all(live), live
    assert lock_keys([s.url for s in servers[2:]], "two-down") == [None] * 3


@pytest.mark.local_redis
@pytest.mark.parametrize("how", ["killed", "paused"])
def test_redlock_three_of_five_down_is_unavailable_fast_and_clean(
    servers: list[RedisServer], how: str
) -> None:
    app = app_for([s.url for s in servers], dlock_node_timeout=0.2)
    with lock(app, "warm-up", ttl=5):
        pass  # connections exist, so paused nodes accept our writes and never answer
    for server in servers[:3]:
        server.kill() if how == "killed" else server.pause()
    started = time.monotonic()
    with pytest.raises(LockUnavailable) as info, lock(app, "three-down", ttl=10):
        pytest.fail("acquired without a quorum")
    elapsed = time.monotonic() - started
    assert elapsed < 0.2 + 0.25, f"took {elapsed:.3f} s; the node timeout is 0.2 s, ttl 10 s"
    assert "2 of 5 node(s) answered, 3 needed" in str(info.value)
    assert len(info.value.errors) == 3
    assert lock_keys([s.url for s in servers[3:]], "three-down") == [None, None]


def test_partial_acquisition_is_undone_at_once(redlock_urls: list[str]) -> None:
    # Someone else holds the key on three of five nodes: we can take only two, and must
    # give those two back before reporting contention.
    foreign = b'{"token":"someone-else","holder":"t-1","host":"h","pid":1,"since":0,"fence":7}'
    for url in redlock_urls[:3]:
        client(url).set("dlock:{split}", foreign, px=10_000)
    with pytest.raises(LockContended) as info, lock(redlock_urls, "split", ttl=10):
        pytest.fail("acquired a minority")
    assert info.value.holder is not None
    assert info.value.holder.task_id == "t-1"
    assert lock_keys(redlock_urls, "split") == [foreign] * 3 + [None] * 2


# -- loss detection and renewal --------------------------------------------------------------


def _hold(urls_or_app: Any, key: str, **options: Any) -> tuple[Lease, threading.Event, list[Any]]:
    lost = threading.Event()
    seen: list[Any] = []

    def on_lost(lease: Lease, error: LockLost) -> None:
        seen.append((time.monotonic(), error))
        lost.set()

    lease = lock(urls_or_app, key, on_lost=on_lost, **options).acquire()
    return lease, lost, seen


def test_deleted_key_is_reported_lost_within_one_renewal_interval(urls: list[str]) -> None:
    lease, lost, seen = _hold(urls, "deleted", ttl=3, renew_interval=0.5)
    delete_lock(urls, "deleted")
    deleted_at = time.monotonic()
    assert lost.wait(timeout=3), "loss not reported"
    delay = seen[0][0] - deleted_at
    assert delay < 0.5 + 0.3, f"reported {delay:.3f} s after the delete"
    assert lease.lost
    assert lease.valid_for == 0
    assert gone(urls) in seen[0][1].reason
    with pytest.raises(LockLost, match=gone(urls)):
        lease.ensure()
    lease.release()


def test_zookeeper_loss_callbacks_that_block_or_raise_stall_no_other_lock(
    zookeeper_urls: list[str],
) -> None:
    """kazoo delivers every watch of a process on one thread: a loss callback run there that
    blocks would stall every other lock's wake-up and loss report. Ours run elsewhere, and the
    lease reads as lost at once, before they run."""
    urls = zookeeper_urls
    entered = threading.Event()
    unblock = threading.Event()

    def blocking(_lease: Lease, _error: LockLost) -> None:
        entered.set()
        unblock.wait(10)

    def raising(_lease: Lease, _error: LockLost) -> None:
        raise RuntimeError("a user callback's own bug")

    first = lock(urls, "blocked-callback", ttl=5, on_lost=blocking).acquire()
    first.on_lost(raising)
    second, second_lost, _ = _hold(urls, "other-key", ttl=5)
    try:
        delete_lock(urls, "blocked-callback")
        assert entered.wait(3), "the loss callback never ran"
        assert first.lost
        with pytest.raises(LockLost, match=gone(urls)):
            first.ensure()
        # While that callback blocks: another key's loss is reported, and a release admits
        # a waiter (both need kazoo's watch thread).
        delete_lock(urls, "other-key")
        assert second_lost.wait(2), "a blocked callback stalled another lease's loss report"
        holder = lock(urls, "handed", ttl=5).acquire()
        admitted = threading.Event()

        def waiter() -> None:
            with lock(urls, "handed", ttl=5, wait=5):
                admitted.set()

        thread = threading.Thread(target=waiter)
        thread.start()
        wait_for(lambda: len(manager_for(urls).queue("handed")) == 2, 3, "the waiter to queue")
        holder.release()
        assert admitted.wait(2), "a blocked callback stalled a waiter's wake-up"
        thread.join(5)
    finally:
        unblock.set()
        first.release()
        second.release()


def test_key_taken_by_another_is_reported_lost(single_urls: list[str]) -> None:
    lease, lost, seen = _hold(single_urls, "stolen", ttl=3, renew_interval=0.3)
    client(single_urls[0]).set("dlock:{stolen}", b"someone else's value")
    assert lost.wait(timeout=3)
    assert "another holder" in seen[0][1].reason
    lease.release()
    assert lock_keys(single_urls, "stolen") == [b"someone else's value"]


@pytest.mark.local_redis
def test_single_redis_restarting_empty_is_reported_lost(server: RedisServer) -> None:
    lease, lost, seen = _hold([server.url], "restart", ttl=3, renew_interval=0.5)
    server.restart(wipe=True)
    restarted_at = time.monotonic()
    assert lost.wait(timeout=3), "loss not reported"
    assert seen[0][0] - restarted_at < 0.5 + 0.3
    assert "gone" in seen[0][1].reason
    lease.release()


@pytest.mark.local_redis
def test_redlock_keeps_lease_through_minority_restart_and_loses_it_on_majority(
    servers: list[RedisServer],
) -> None:
    urls = [s.url for s in servers]
    lease, lost, seen = _hold(urls, "wipes", ttl=2, renew_interval=0.3)
    servers[0].restart(wipe=True)
    servers[1].wipe()
    # Three renewals later the lease still holds, and has re-taken the key where it vanished.
    renewals = lease.renewals
    wait_for(lambda: lease.renewals >= renewals + 3, 3, "three renewals")
    assert not lost.is_set()
    assert all(lock_keys(urls, "wipes"))
    for server in servers[2:]:
        server.wipe()
    for server in servers[:2]:
        server.wipe()
    wiped_at = time.monotonic()
    assert lost.wait(timeout=3)
    assert seen[0][0] - wiped_at < 0.3 + 0.3
    lease.release()


@pytest.mark.redis_only(
    "samples the Redis key's PTTL between renewals; a ZooKeeper lease has no ttl (its node "
    "lasts with the session, see test_zookeeper_lock's session tests)"
)
def test_renewal_keeps_lease_alive_for_five_ttls(urls: list[str]) -> None:
    ttl = 0.6
    lease = lock(urls, "long", ttl=ttl).acquire()
    raw = client(urls[0])
    lowest = ttl * 1000
    end = time.monotonic() + 5.5 * ttl
    while time.monotonic() < end:  # the holding time under test, sampled
        lowest = min(lowest, raw.pttl("dlock:{long}"))
        assert not lease.lost
        time.sleep(0.05)
    lease.ensure()
    assert lowest > 0, "the key expired between renewals"
    assert lease.renewals >= 10
    assert lease.release()


def test_max_hold_stops_renewal_and_reports_loss(single_urls: list[str]) -> None:
    lease, lost, seen = _hold(single_urls, "bounded", ttl=0.6, max_hold=1.0)
    assert lost.wait(timeout=4)
    held_for = seen[0][0] - lease.acquired_at
    assert 1.0 <= held_for < 1.0 + 0.6 + 0.2, held_for
    assert "max_hold" in seen[0][1].reason
    # The key was not renewed past the bound: it is gone or about to go by itself.
    assert client(single_urls[0]).pttl("dlock:{bounded}") <= 600
    lease.release()


def test_validity_runs_out_on_the_monotonic_clock_before_redis_notices(
    single_urls: list[str],
) -> None:
    freezegun = pytest.importorskip("freezegun")
    with freezegun.freeze_time("2030-01-01") as clock:
        lease = lock(single_urls, "paused", ttl=10, renew=False).acquire()
        lease.ensure()
        clock.tick(9.95)  # a 10 s pause (GC, SIGSTOP): the drift allowance has passed
        assert lease.lost
        assert lease.valid_for == 0
        with pytest.raises(LockLost, match="validity ran out"):
            lease.ensure()
        # Redis still has the key: only the client's own clock knew.
        assert lock_keys(single_urls, "paused")[0] is not None
        lease.release()


def test_wall_clock_jumps_do_not_change_validity(
    urls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_time = time.time
    if on_zookeeper(urls):
        # Validity follows the session: a 2 s one, confirmed every 2/3 s, plays the ttl.
        urls = [f"{urls[0]}?timeout=2"]
    lease = lock(urls, "wall", ttl=2, renew_interval=0.3).acquire()
    interval = lease.renew_interval or 0.3
    before = lease.valid_for
    for jump in (5 * 3600, -5 * 3600):
        monkeypatch.setattr(time, "time", lambda j=jump: real_time() + j)
        monkeypatch.setattr(time, "time_ns", lambda j=jump: int((real_time() + j) * 1e9))
        assert abs(lease.valid_for - before) < interval + 0.1
        lease.ensure()
        renewals = lease.renewals
        wait_for(lambda r=renewals: lease.renewals > r, 2, "a renewal under the jumped clock")
        assert not lease.lost
        assert 2 - interval - 0.2 < lease.valid_for <= 2
    assert lease.release()


# -- ownership -------------------------------------------------------------------------------


@pytest.mark.redis_only(
    "forges a Redis lock value (another nonce in the head); a ZooKeeper lease is its own node, "
    "released and confirmed by that node's path"
)
def test_non_owner_cannot_release_or_extend(urls: list[str]) -> None:
    manager = manager_for(urls)
    owner = manager.acquire("owned", ttl=5, renew=False)
    impostor = Lease(
        manager,
        "owned",
        owner.token,
        owner.head.replace(owner.head[10:20], "x" * 10),
        holder=None,
        ttl=60,
        started=time.monotonic(),
        deadline=time.monotonic() + 60,
        renew_interval=None,
        max_hold=None,
    )
    assert manager.renew([impostor]) == ["another holder has the key" + _on_all(urls)]
    assert impostor.release() is False
    pttl = client(urls[0]).pttl("dlock:{owned}")
    assert 0 < pttl <= 5000, "the impostor's extend changed the owner's ttl"
    assert all(
        v is not None and v.startswith(owner.head.encode()) for v in lock_keys(urls, "owned")
    )
    assert owner.release()
    assert lock_keys(urls, "owned") == [None] * len(urls)


def _on_all(urls: list[str]) -> str:
    return "" if len(urls) == 1 else f" on {len(urls)} of {len(urls)} nodes"


def test_release_by_task_id(urls: list[str]) -> None:
    manager = manager_for(urls)
    lease, lost, seen = _hold(urls, "by-holder", ttl=5, renew_interval=0.3, holder="task-42")
    assert manager.release_by_task("by-holder", "task-41") is False
    assert manager.holder("by-holder") is not None
    assert manager.release_by_task("by-holder", "task-42") is True
    assert manager.holder("by-holder") is None
    # The holder learns of it at its next renewal (on ZooKeeper, from its node's watch).
    assert lost.wait(timeout=2)
    assert gone(urls) in seen[0][1].reason
    lease.release()


def test_contended_error_names_the_holder(urls: list[str]) -> None:
    with lock(urls, "busy", ttl=5, holder="task-7"):
        with pytest.raises(LockContended) as info, lock(urls, "busy", ttl=5):
            pytest.fail("acquired a held key")
        error = info.value
        assert error.key == "busy"
        assert error.holder is not None
        assert error.holder.task_id == "task-7"
        assert error.holder.pid == os.getpid()
        assert "task task-7" in str(error)
        if on_zookeeper(urls):
            # No ttl: the holder keeps the key for as long as it runs, so no time is promised.
            assert error.retry_after is None
        else:
            assert error.retry_after is not None
            assert 4 < error.retry_after <= 5


# -- fencing ---------------------------------------------------------------------------------


def test_fencing_tokens_increase_over_1000_acquisitions_single(single_urls: list[str]) -> None:
    manager = manager_for(single_urls)
    last = 0
    for _ in range(1000):
        lease = manager.acquire("fence", ttl=5, renew=False)
        assert lease.token > last
        last = lease.token
        lease.release()


def test_fencing_tokens_increase_with_minority_wiped_between_acquisitions(
    redlock_urls: list[str],
) -> None:
    manager = manager_for(redlock_urls)
    clients = [client(u) for u in redlock_urls]
    last = 0
    for i in range(1000):
        lease = manager.acquire("fence", ttl=5, renew=False)
        assert lease.token > last, f"acquisition {i}: {lease.token} after {last}"
        last = lease.token
        lease.release()
        # Wipe one or two nodes (a minority), a different set each time.
        for j in range(1 + i % 2):
            clients[(i + j) % 5].flushdb()


@pytest.mark.local_redis
def test_fencing_tokens_increase_across_an_empty_restart_of_a_single_redis(
    server: RedisServer,
) -> None:
    manager = manager_for([server.url])
    before = manager.acquire("fence", ttl=5, renew=False)
    before.release()
    server.restart(wipe=True)
    after = manager.acquire("fence", ttl=5, renew=False)
    assert after.token > before.token
    after.release()


# -- waiting ---------------------------------------------------------------------------------


@pytest.mark.redis_only(
    "counts the Redis backend's BLPOP wake-ups; on ZooKeeper one waiter per release, in "
    "order, is test_zookeeper_lock's test_a_release_wakes_only_the_next_waiter"
)
def test_each_release_admits_exactly_one_of_ten_waiters(
    urls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import celery_dlock.backends.redis.redlock as redlock_module

    pops = {"started": 0, "returned": 0}
    state = threading.Condition()
    original = redlock_module.blocking_pop

    def counted_pop(*args: Any) -> bool:
        with state:
            pops["started"] += 1
            state.notify_all()
        try:
            return original(*args)
        finally:
            with state:
                pops["returned"] += 1
                state.notify_all()

    monkeypatch.setattr(redlock_module, "blocking_pop", counted_pop)
    admitted: list[int] = []
    go = [threading.Event() for _ in range(10)]

    def waiter(n: int) -> None:
        with lock(urls, "queue", ttl=30, wait=60):
            with state:
                admitted.append(n)
                state.notify_all()
            go[n].wait(timeout=60)

    first = lock(urls, "queue", ttl=30).acquire()
    threads = [threading.Thread(target=waiter, args=(n,)) for n in range(10)]
    for thread in threads:
        thread.start()
    with state:
        assert state.wait_for(lambda: pops["started"] == 10, timeout=10), pops
    first.release()
    for turn in range(10):
        with state:
            assert state.wait_for(lambda t=turn: len(admitted) == t + 1, timeout=10)
            # Exactly one waiter woke: one pop returned per release, and nobody went back
            # to sleep (a herd would show as extra pops started and returned).
            assert pops == {"started": 10, "returned": turn + 1}, (turn, pops)
        go[admitted[-1]].set()
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(admitted) == list(range(10))


def test_wait_gives_up_after_its_bound(urls: list[str]) -> None:
    with lock(urls, "bounded-wait", ttl=30):
        started = time.monotonic()
        with pytest.raises(LockContended), lock(urls, "bounded-wait", wait=0.3):
            pytest.fail("acquired a held key")
        assert 0.3 <= time.monotonic() - started < 0.3 + 0.3


@pytest.mark.redis_only(
    "plays a dead holder by a ttl left to run out; a ZooKeeper lock has no ttl and ends with "
    "its holder's session (test_zookeeper_lock's session-expiry and fork tests)"
)
def test_waiter_takes_over_when_holder_expires(urls: list[str]) -> None:
    holder = lock(urls, "crashed", ttl=0.5, renew=False).acquire()  # a holder that died
    started = time.monotonic()
    with lock(urls, "crashed", ttl=5, wait=5) as lease:
        waited = time.monotonic() - started
        assert lease.token > holder.token
    assert 0.4 <= waited < 0.5 + 0.3
    holder.release()


# -- the lock() front end --------------------------------------------------------------------


def test_lock_as_decorator(single_urls: list[str]) -> None:
    calls = []

    @lock(single_urls, "decorated", ttl=5)
    def critical(x: int) -> int:
        calls.append(lock_keys(single_urls, "decorated")[0] is not None)
        return x * 2

    assert critical(21) == 42
    assert critical(1) == 2
    assert calls == [True, True]
    assert lock_keys(single_urls, "decorated") == [None]


def test_one_guard_entered_by_two_threads_releases_each_threads_own_lease(
    single_urls: list[str],
) -> None:
    """One guard (as a decorator is) entered by two threads at once: that happens when the
    first thread's key was taken from it and the second took it. The first thread leaving
    must release its own lease, not the second thread's."""
    guard = lock(single_urls, "shared-guard", ttl=5, wait=None, renew=False)
    first_in, second_in, first_out, second_may_leave = (threading.Event() for _ in range(4))
    leases: dict[str, Lease] = {}
    errors: list[BaseException] = []

    def hold(name: str, entered: threading.Event, until: threading.Event) -> None:
        try:
            with guard as lease:
                leases[name] = lease
                entered.set()
                assert until.wait(10)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            if name == "first":
                first_out.set()

    threads = [
        threading.Thread(target=hold, args=("first", first_in, second_in)),
        threading.Thread(target=hold, args=("second", second_in, second_may_leave)),
    ]
    threads[0].start()
    assert first_in.wait(10)
    delete_lock(single_urls, "shared-guard")  # taken from the first thread behind its back
    threads[1].start()
    assert first_out.wait(10), "the first thread did not leave its block"
    second_lease = leases["second"]
    assert not second_lease.released
    held = lock_keys(single_urls, "shared-guard")[0]
    assert held is not None, "the first thread's exit released the second thread's lease"
    assert held.startswith(second_lease.head.encode())
    second_may_leave.set()
    for thread in threads:
        thread.join(timeout=10)
    assert not errors, errors
    assert leases["first"].released
    assert second_lease.released
    assert lock_keys(single_urls, "shared-guard") == [None]

    once = lock(single_urls, "shared-guard", ttl=5)  # wait=0: a nested entry is refused
    with once as outer:
        with pytest.raises(LockContended), once:
            pass
        assert not outer.released
        outer.ensure()
    assert outer.released


def test_a_guard_takes_attributes_and_weak_references_as_before_its_slots(
    single_urls: list[str],
) -> None:
    """A guard is a plain object to its users: they patch its methods in their own tests,
    set attributes on it and keep weak references to it (as before it got ``__slots__``)."""
    guard = lock(single_urls, "patchable", ttl=5, renew=False)
    assert weakref.ref(guard)() is guard
    guard.note = "set by a user"  # type: ignore[attr-defined]
    assert vars(guard) == {"note": "set by a user"}
    # mock.patch.object sets the instance attribute; the real acquire still runs (wraps).
    with mock.patch.object(guard, "acquire", wraps=guard.acquire) as spy:
        with guard as lease:
            assert lock_keys(single_urls, "patchable")[0] is not None
        spy.assert_called_once_with()
    assert lease.released
    assert lock_keys(single_urls, "patchable") == [None]
    assert "acquire" not in vars(guard)  # the patch undone: the class's method again


def test_a_guard_built_directly_passes_every_option_it_is_given(single_urls: list[str]) -> None:
    """``LockGuard(manager, key, ttl, wait, options)`` hands the backend all of ``options``, as
    it always did, not only the four that lock() sets."""
    from celery_dlock import LockGuard

    manager = manager_for(single_urls)
    options = {"holder": None, "interval": None, "max_hold": None, "on_lost": None}
    with LockGuard(manager, "direct-guard", 5.0, 0.0, {**options, "fence_retention": 60.0}):
        retention = client(single_urls[0]).pttl("dlock:{direct-guard}:fence")
    assert 50_000 < retention <= 60_000, retention
    with pytest.raises(TypeError), LockGuard(manager, "direct-guard", 5.0, 0.0, {}):
        pass  # acquire_checked's required options missing: refused as before


def test_leaving_the_block_after_loss_raises_lock_lost(urls: list[str]) -> None:
    with (
        pytest.raises(LockLost, match=gone(urls)),
        lock(urls, "exit", ttl=3, renew_interval=0.2) as lease,
    ):
        delete_lock(urls, "exit")
        wait_for(lambda: lease.lost, 2, "the loss")
    with pytest.raises(KeyError), lock(urls, "exit2", ttl=3, renew_interval=0.2) as lease:
        delete_lock(urls, "exit2")
        wait_for(lambda: lease.lost, 2, "the loss")
        raise KeyError("the block's own error wins")


def test_lock_reads_app_settings(single_urls: list[str]) -> None:
    app = app_for(single_urls, dlock_ttl=7, dlock_prefix="myapp")
    with lock(app, "conf") as lease:
        assert lease.ttl == 7
        assert client(single_urls[0]).exists("myapp:{conf}")


def test_lock_falls_back_to_a_redis_broker(single_urls: list[str]) -> None:
    app = Celery("test", set_as_current=False, broker=single_urls[0])
    with lock(app, "broker-fallback", ttl=5):
        assert lock_keys(single_urls, "broker-fallback")[0] is not None


class FrozenApp(Celery):
    """A Celery app that refuses attributes set after its construction (as some projects
    freeze theirs): lock() must keep its backend elsewhere, as it did before."""

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False) and not hasattr(self, name):
            raise AttributeError(f"{type(self).__name__} is frozen; cannot set {name!r}")
        super().__setattr__(name, value)

    def freeze(self) -> None:
        self._frozen = True


def test_lock_on_an_app_refusing_attributes_reads_its_settings_once(
    single_urls: list[str],
) -> None:
    """An app whose ``__setattr__`` refuses new attributes: its settings are read once (as for
    any app) and forget() drops them, so a changed prefix shows after forget() only."""
    app = FrozenApp("frozen", set_as_current=False)
    app.conf.dlock_urls = single_urls
    app.conf.dlock_prefix = "frozen1"
    app.freeze()
    try:
        with lock(app, "frozen-key", ttl=5, renew=False):
            assert client(single_urls[0]).exists("frozen1:{frozen-key}")
        assert manager_for(app) is manager_for(app)
        app.conf.dlock_prefix = "frozen2"
        assert manager_for(app).settings.prefix == "frozen1"  # read once, until forget()
        forget(app)
        with lock(app, "frozen-key", ttl=5, renew=False):
            assert client(single_urls[0]).exists("frozen2:{frozen-key}")
    finally:
        forget(app)


def test_lock_on_current_app_follows_the_current_app(single_urls: list[str]) -> None:
    """``celery.current_app`` (a proxy, not weakly referable) names whichever app is current:
    lock() uses that app's settings, and forget(current_app) forgets the current app's."""
    before = current_app._get_current_object()
    first = app_for(single_urls, dlock_prefix="current1")
    second = app_for(single_urls, dlock_prefix="current2")
    try:
        first.set_current()
        assert lock(current_app, "now", ttl=5).acquire().release()
        assert client(single_urls[0]).exists("current1:{now}:fence")
        second.set_current()
        assert manager_for(current_app) is manager_for(second)
        assert manager_for(current_app).settings.prefix == "current2"
        second.conf.dlock_prefix = "current3"
        forget(current_app)
        assert manager_for(second).settings.prefix == "current3"
        assert manager_for(first).settings.prefix == "current1"
    finally:
        before.set_current()
        forget(first)
        forget(second)


# -- fork ------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork with threads, 3.12+
def test_forked_child_renews_its_own_leases_not_the_parents(single_urls: list[str]) -> None:
    parent_lease = lock(single_urls, "parent", ttl=5, renew_interval=0.2).acquire()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        code = 1
        try:
            child = lock(single_urls, "child", ttl=0.6).acquire()
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                time.sleep(0.05)
            ok = not child.lost and child.renewals >= 3 and child.release()
            ok = ok and len(watchdog) == 0
            code = 0 if ok else 2
        finally:
            os.write(write, bytes([code]))
            os._exit(code)
    os.close(write)
    result = os.read(read, 1)
    os.waitpid(pid, 0)
    assert result == b"\x00", "the child's lease was not renewed by its own watchdog"
    assert not parent_lease.lost
    assert parent_lease.release()


def test_commands_packed_in_c_match_redis_py() -> None:
    """The hiredis packer our transport calls directly writes what redis-py's serializer
    would, for every kind of argument a script call carries; other kinds fall back to it."""
    from redis.connection import Connection
    from redis.exceptions import DataError

    from celery_dlock.backends.redis.owed import PROBE_COMMAND, SKIP_REPLY, pack

    conn = Connection()
    command = ("EVALSHA", "ab" * 20, 3, "k:é", "f", "v", '{"holder":"x"}', "60000", 0, 1.5, b"\x00")
    assert b"".join(pack(conn, command)) == b"".join(conn.pack_command(*command))
    with pytest.raises(DataError):  # redis-py's own error, as before
        pack(conn, ("GET", object()))
    # the reply-less release's constant prefix and probe, written out as bytes
    assert b"".join(conn.pack_command("CLIENT", "REPLY", "SKIP")) == SKIP_REPLY
    probe = ("EVAL", "return 'dlock-skip-probe'", 0)
    assert b"".join(conn.pack_command(*probe)) == PROBE_COMMAND


# -- releases nobody waits for ---------------------------------------------------------------


@pytest.mark.redis_only("about Redis's CLIENT REPLY SKIP and SCRIPT FLUSH")
def test_release_without_waiting_gets_no_reply_and_frees_the_key(urls: list[str]) -> None:
    """A task's release goes out after ``CLIENT REPLY SKIP``, as source: the key goes, the
    server writes no reply, and later commands still read their own replies, also after a
    ``SCRIPT FLUSH`` (an EVALSHA whose NOSCRIPT nobody reads would be lost)."""
    from celery_dlock.backends.redis.connecting import stale
    from celery_dlock.backends.redis.owed import entries, skippable

    manager = manager_for(urls)
    for i in range(30):
        key = f"skip-{i}"
        lease = manager.acquire(key, ttl=30, renew=False)
        assert lease.token > 0
        lease.release(wait=False)
        wait_for(lambda k=key: lock_keys(urls, k) == [None] * len(urls), 2, f"{key} released")
        if i == 10:
            for url in urls:
                client(url).script_flush()
    for node in manager.nodes:
        conn = node.connection()
        assert skippable(conn) is True
        assert not entries(conn)
        assert not stale(conn), "a reply (or EOF) is waiting on the socket"


def test_release_without_client_reply_permission_awaits_replies(server: RedisServer) -> None:
    """An ACL user with only the documented rules may not run ``CLIENT REPLY``: the first
    release's probe finds that out, and releases go back to replies read later, none misread."""
    from celery_dlock.backends.redis.diagnose import acl_rules
    from celery_dlock.backends.redis.owed import entries, skippable

    client(server.url).execute_command(
        "ACL", "SETUSER", "noskip", "reset", "on", ">pw", "-@all", *acl_rules().split()
    )
    url = server.url.replace("redis://", "redis://noskip:pw@", 1)
    manager = manager_for([url])
    for i in range(20):
        key = f"noskip-{i}"
        lease = manager.acquire(key, ttl=30, renew=False)
        lease.release(wait=False)
        wait_for(lambda k=key: lock_keys([server.url], k) == [None], 2, f"{key} released")
    conn = manager.nodes[0].connection()
    assert skippable(conn) is False
    assert len(entries(conn)) == 1  # the last release's reply, read before the next
    with lock([url], "noskip-after", ttl=5) as lease:
        assert lease.token > 0


def test_release_after_validity_ran_out_reports_the_loss(
    single_urls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder that ends after its validity ran out, before any watchdog noticed, still has
    the loss reported (signal and log), whichever thread gets there first."""
    from celery_dlock import lock_lost

    manager = manager_for(single_urls)
    seen: list[dict[str, Any]] = []

    def record(sender: Any = None, **kw: Any) -> None:
        seen.append(kw)

    # Taken while nobody listens for losses (other tests' receivers aside): such a lease is
    # not watched (test_a_lease_that_is_not_renewed_reports_its_loss); only the clock knows.
    monkeypatch.setattr(lock_lost, "receivers", [])
    lease = manager.acquire("ran-out", ttl=0.2, renew=False)
    monkeypatch.undo()
    lock_lost.connect(record, weak=False)
    try:
        wait_for(lambda: lease.lost, 2, "the validity to run out")
        assert seen == []  # nobody renews or watches this lease: only the clock knows
        lease.release(wait=False)
        assert [s["key"] for s in seen] == ["ran-out"]
        assert "validity" in seen[0]["reason"] or "expired" in seen[0]["reason"], seen[0]
        lease.release()  # idempotent: reported once
        assert len(seen) == 1
    finally:
        lock_lost.disconnect(record)
