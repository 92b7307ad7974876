"""The backend contract (:mod:`celery_dlock.core.backend`), one test module that every backend runs
unchanged: the in-process table (``memory://``), a single Redis, Redlock over five masters and
a ZooKeeper server.

Each test talks to the backend only through the ``Backend`` protocol (acquire, release,
renew by the watchdog, forget, holder, release_nonce, release_by_task, force_release), so a
new backend passes by keeping the promises, not by resembling Redis. Times derive from the
ttls the tests set; nothing sleeps to synchronise (events and polls with deadlines).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from celery_dlock import LockContended, LockLost
from celery_dlock.core.backend import Backend
from celery_dlock.core.config import Settings
from celery_dlock.core.holder import head_nonce
from celery_dlock.core.lease import Lease
from celery_dlock.core.urls import backend_module

#: Every backend the suite runs on (docs/internals.md names them).
STORES = ("memory", "single", "redlock5", "zookeeper")
#: A lease's ttl in these tests: short enough to expire within a test, long enough for a
#: busy two-core host to renew it in time (renewal at ttl/3).
TTL = 1.5
_tables = itertools.count()


def until(check: Callable[[], bool], seconds: float, what: str) -> None:
    """Poll ``check`` until true, failing after ``seconds`` (derived from a ttl) with ``what``."""
    end = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < end, f"not within {seconds:g} s: {what}"
        time.sleep(0.01)


@pytest.fixture(params=STORES)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """A fresh backend of each kind over an emptied store (a table of its own for memory)."""
    if request.param == "memory":
        urls = [f"memory://contract-{next(_tables)}"]
    else:
        fixture = {"single": "single_urls", "redlock5": "redlock_urls"}.get(
            request.param, "zookeeper_urls"
        )
        urls = request.getfixturevalue(fixture)
        if request.param == "zookeeper":
            # The session timeout is the ZooKeeper lease's ttl: a dead holder's key frees
            # after it, as a Redis key after its ttl.
            urls = [f"{urls[0]}?timeout=3"]
    made: Backend = backend_module(urls).make_backend(Settings(urls=tuple(urls), ttl=TTL))
    yield made
    made.close()


def held_by(backend: Backend, key: str, lease: Lease) -> bool:
    """Whether the store names ``lease``'s acquisition as ``key``'s holder."""
    holder = backend.holder(key)
    return holder is not None and holder.nonce == head_nonce(lease.head)


def in_line(backend: Backend, key: str, count: int) -> None:
    """Until ``count`` contenders wait for ``key``, where the backend can tell (memory: its
    line; ZooKeeper: the nodes queued behind the holder). A Redis waiter leaves no trace to
    count (it blocks on a signal list): there the waiters get a head start of 0.3 s, and a
    waiter not yet waiting at a release only means that release has none to hand over to."""
    waiting = getattr(backend, "waiting", None)
    queue = getattr(backend, "queue", None)
    if waiting is not None:
        until(lambda: waiting(key) >= count, 10 * TTL, f"{count} waiters in line")
    elif queue is not None:
        until(lambda: len(queue(key)) >= count + 1, 10 * TTL, f"{count} waiters in line")
    else:
        time.sleep(0.3)


def test_exclusion_refuses_a_second_holder_naming_the_first(backend: Backend) -> None:
    lease = backend.acquire("contract:excl", holder="task-a")
    try:
        with pytest.raises(LockContended) as refused:
            backend.acquire("contract:excl", holder="task-b")
        assert refused.value.holder is not None
        assert refused.value.holder.task_id == "task-a"
        assert held_by(backend, "contract:excl", lease)
    finally:
        lease.release()
    backend.acquire("contract:excl", holder="task-b").release()


def test_exclusion_across_threads(backend: Backend) -> None:
    """Threads contending for one key with waits never hold it at once; each gets it."""
    inside = 0
    most = 0
    done: list[int] = []
    guard = threading.Lock()
    errors: list[BaseException] = []

    def contend(i: int) -> None:
        nonlocal inside, most
        try:
            for _ in range(3):
                lease = backend.acquire("contract:threads", wait=20 * TTL, holder=f"t{i}")
                with guard:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0.005)  # the critical section's work
                with guard:
                    inside -= 1
                lease.ensure()
                lease.release()
            done.append(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60 * TTL)
    assert not errors, errors
    assert sorted(done) == [0, 1, 2, 3]
    assert most == 1


def test_fencing_tokens_rise_strictly_per_key(backend: Backend) -> None:
    tokens = []
    for _ in range(5):
        lease = backend.acquire("contract:fence")
        tokens.append(lease.token)
        lease.release()
    other = backend.acquire("contract:fence-other")
    other.release()
    lease = backend.acquire("contract:fence")
    tokens.append(lease.token)
    # An operator's forced release moves the counter on: the next holder's token is larger.
    holder = backend.holder("contract:fence")
    assert holder is not None
    assert backend.force_release("contract:fence", holder)
    lease.release()
    after = backend.acquire("contract:fence")
    tokens.append(after.token)
    after.release()
    assert all(isinstance(t, int) for t in tokens)
    assert tokens == sorted(set(tokens)), tokens


def test_waiters_are_handed_the_key_one_per_release(backend: Backend) -> None:
    """Each release hands the key to one waiter; the others keep waiting, none errs."""
    first = backend.acquire("contract:line", holder="holder")
    got: list[Lease] = []
    errors: list[BaseException] = []
    cond = threading.Condition()

    def wait_for_it(i: int) -> None:
        try:
            lease = backend.acquire("contract:line", wait=30 * TTL, holder=f"w{i}")
        except BaseException as exc:
            errors.append(exc)
            return
        with cond:
            got.append(lease)
            cond.notify_all()

    waiters = [threading.Thread(target=wait_for_it, args=(i,)) for i in range(3)]
    for thread in waiters:
        thread.start()
    try:
        in_line(backend, "contract:line", 3)
        assert not got
        previous = first
        for n in range(1, 4):
            previous.release()
            with cond:
                assert cond.wait_for(lambda n=n: len(got) >= n, timeout=10 * TTL), n
                assert len(got) == n  # one release, one waiter through
            previous = got[-1]
            assert held_by(backend, "contract:line", previous)
            assert previous.token > first.token
        previous.release()
    finally:
        for thread in waiters:
            thread.join(timeout=30 * TTL)
        for lease in got:
            lease.release()
    assert not errors, errors
    assert len({lease.holder for lease in got}) == 3


def test_a_wait_ends_with_contended_after_its_length(backend: Backend) -> None:
    lease = backend.acquire("contract:waitout")
    try:
        begun = time.monotonic()
        with pytest.raises(LockContended):
            backend.acquire("contract:waitout", wait=0.3)
        assert 0.3 <= time.monotonic() - begun < 0.3 + 3 * TTL
    finally:
        lease.release()


def test_validity_is_at_most_the_ttl_and_counts_down(backend: Backend) -> None:
    lease = backend.acquire("contract:valid", renew=False)
    try:
        first = lease.valid_for
        assert 0 < first <= TTL + 3  # a ZooKeeper lease's validity is its session's
        until(lambda: lease.valid_for < first, TTL, "validity did not count down")
        lease.ensure()
    finally:
        lease.release()


def test_a_crashed_holders_key_frees_after_its_ttl_with_a_larger_token(
    backend: Backend,
) -> None:
    """A holder that stops renewing and never releases (a crash: ``forget``) holds the key
    for its ttl, then the next holder gets it, with a larger fencing token."""
    crashed = backend.acquire("contract:crash", ttl=TTL, holder="crashed")
    backend.forget(crashed)
    with pytest.raises(LockContended):
        backend.acquire("contract:crash")
    begun = time.monotonic()
    nxt = backend.acquire("contract:crash", wait=10 * TTL, holder="next")
    try:
        assert time.monotonic() - begun < 10 * TTL
        assert nxt.token > crashed.token
        holder = backend.holder("contract:crash")
        assert holder is not None
        assert holder.task_id == "next"
    finally:
        nxt.release()


def test_release_is_by_the_owner_only(backend: Backend) -> None:
    lease = backend.acquire("contract:owner", holder="task-a")
    try:
        assert not backend.release_nonce("contract:owner", "not-this-acquisition")
        assert not backend.release_by_task("contract:owner", "task-b")
        assert held_by(backend, "contract:owner", lease)
    finally:
        assert lease.release()
    assert not lease.release()  # idempotent: a second release deletes nothing
    other = backend.acquire("contract:owner", holder="task-b")
    try:
        assert not lease.release()  # the old lease cannot delete the new holder's key
        assert held_by(backend, "contract:owner", other)
        assert backend.release_by_task("contract:owner", "task-b")
        assert backend.holder("contract:owner") is None
    finally:
        other.release()


def test_renewal_keeps_a_lease_past_its_ttl(backend: Backend) -> None:
    lease = backend.acquire("contract:renew", ttl=TTL)
    try:
        end = time.monotonic() + 2.5 * TTL
        while time.monotonic() < end:
            lease.ensure()  # valid throughout: the watchdog renews it
            time.sleep(0.05)
        assert not lease.lost
        assert held_by(backend, "contract:renew", lease)
        with pytest.raises(LockContended):
            backend.acquire("contract:renew")
    finally:
        lease.release()


def test_a_lost_lease_is_reported(backend: Backend) -> None:
    """A lease released from under its holder (an operator's forced release) is reported lost:
    its callback runs with LockLost, ``lost`` turns true, ``ensure()`` raises, and the next
    holder's token is larger."""
    told: list[LockLost] = []
    noticed = threading.Event()

    def on_lost(lease: Lease, error: LockLost) -> None:
        told.append(error)
        noticed.set()

    lease = backend.acquire("contract:lost", ttl=TTL, on_lost=on_lost)
    try:
        holder = backend.holder("contract:lost")
        assert holder is not None
        assert backend.force_release("contract:lost", holder)
        assert noticed.wait(5 * TTL), "loss not reported within the renewal's reach"
        assert lease.lost
        with pytest.raises(LockLost):
            lease.ensure()
        assert told[0].key == "contract:lost"
        nxt = backend.acquire("contract:lost", wait=5 * TTL)
        assert nxt.token > lease.token
        nxt.release()
    finally:
        lease.release()
