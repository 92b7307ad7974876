"""Timed nodes on a real ZooKeeper: queued locks (enqueue-time mode) and their adoption, the
hand-over to a retry, forgotten leases (beat tick keys) outliving their process.

Each test asserts the behaviour its name states; synchronisation is by polls with deadlines
and events, never by bare sleeps. A "not admitted" check waits a bounded time for something
that must not happen.
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from celery_dlock.backends.zookeeper import ZooKeeperBackend, close_all
from celery_dlock.backends.zookeeper.nodes import parse_name
from celery_dlock.core.errors import LockContended
from celery_dlock.core.lease import Lease
from tests.support.celery_fixtures import make_mode, point_at_broker, submit_concurrently
from tests.support.workers import Journal, Worker, use_lock_urls
from tests.support.zookeeper import ZkServer, ensemble, skip_reason, standalone, until

REASON = skip_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def zk() -> Iterator[ZkServer]:
    if REASON is not None:
        pytest.skip(REASON)
    with standalone() as server:
        yield server


@pytest.fixture
def url(zk: ZkServer) -> Iterator[str]:
    """A fresh chroot on the standalone server; every client of this process closed after."""
    yield f"zookeeper://{zk.hosts}/q-{uuid.uuid4().hex[:8]}?timeout=4"
    close_all()


def other(url: str) -> ZooKeeperBackend:
    """A backend on another session (another client) of the same server."""
    return ZooKeeperBackend(url.replace("timeout=4", "timeout=4.5"))


def in_other_process(url: str, code: str) -> str:
    """Run ``code`` (with ``b``, a backend on ``url``) in a new Python process that then exits
    (closing its session): its stdout."""
    program = "\n".join(
        [
            "from celery_dlock.backends.zookeeper import ZooKeeperBackend",
            f"b = ZooKeeperBackend({url!r})",
            code,
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def queued(backend: ZooKeeperBackend, key: str, n: int) -> bool:
    """True once ``key`` has ``n`` nodes (its holder and waiters)."""
    return len(backend.queue(key)) == n


def stays(check: Callable[[], bool], seconds: float) -> bool:
    """True if ``check`` stays true for ``seconds`` (a bounded wait for what must not happen)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not check():
            return False
        time.sleep(0.005)  # a poll, bounded by the deadline
    return check()


def publish(backend: ZooKeeperBackend, key: str, task_id: str, ttl: float = 30.0) -> Lease:
    """What enqueue-time mode does at publish: send the queued lock, read it, forget it."""
    pending = backend.send_queued(key, ttl, holder=task_id)
    assert pending is not None
    lease = pending.finish()
    backend.forget(lease)
    return lease


def waiter(
    backend: ZooKeeperBackend,
    key: str,
    order: list[str],
    name: str,
    tokens: list[int] | None = None,
    **kwargs: object,
) -> threading.Thread:
    """A thread that waits for ``key``, appends ``name`` to ``order`` (and its lease's token
    to ``tokens``) once in, and releases."""

    def run() -> None:
        with backend.acquire(key, wait=30, holder=name, **kwargs) as lease:  # type: ignore[arg-type]
            order.append(name)
            if tokens is not None:
                tokens.append(lease.token)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


# -- queued locks -------------------------------------------------------------------------------


def test_a_queued_lock_outlives_the_process_that_published_it(url: str) -> None:
    out = in_other_process(
        url,
        "p = b.send_queued('report', 30, holder='task-q')\n"
        "lease = p.finish()\nb.forget(lease)\nprint(lease.token)",
    )
    token = int(out)
    backend = other(url)
    holder = backend.holder("report")  # the publisher and its session are gone
    assert holder is not None
    assert (holder.task_id, holder.queued, holder.fence) == ("task-q", True, token)
    info = backend.inspect("report")
    assert info.ttl_left is not None
    assert 20 < info.ttl_left <= 30


def test_a_duplicate_sees_the_queued_holder(url: str) -> None:
    first = publish(ZooKeeperBackend(url), "dup", "task-1")
    with pytest.raises(LockContended) as caught:
        publish(other(url), "dup", "task-2")
    assert caught.value.holder is not None
    assert caught.value.holder.task_id == "task-1"
    assert caught.value.holder.queued
    assert caught.value.holder.fence == first.token
    # The refused duplicate left no node behind.
    assert len(other(url).queue("dup")) == 1


def test_the_matching_acquire_adopts_the_queued_lock_with_a_larger_token(url: str) -> None:
    queued = publish(ZooKeeperBackend(url), "adopt", "task-a")
    worker = other(url)
    lease = worker.acquire("adopt", holder="task-a", takeover="task-a")
    holder = worker.holder("adopt")
    assert holder is not None
    assert (holder.task_id, holder.queued) == ("task-a", False)
    assert lease.token > queued.token
    assert len(worker.queue("adopt")) == 1  # the queued node went with the adoption
    name = parse_name(lease.path.rsplit("/", 1)[1])
    assert name is not None
    assert not name.timed  # a session node: it ends with the worker's session
    lease.release()
    assert worker.holder("adopt") is None


def test_a_non_matching_acquire_is_refused_or_waits_until_the_adopter_releases(url: str) -> None:
    publish(ZooKeeperBackend(url), "other", "task-a")
    worker = other(url)
    with pytest.raises(LockContended) as caught:
        worker.acquire("other", holder="task-b", takeover="task-b")
    assert caught.value.holder is not None
    assert caught.value.holder.task_id == "task-a"
    order: list[str] = []
    waiting = waiter(ZooKeeperBackend(url), "other", order, "task-b", takeover="task-b")
    until(lambda: len(worker.queue("other")) == 2, 10, "the waiter queued")
    adopted = worker.acquire("other", holder="task-a", takeover="task-a")
    assert stays(lambda: order == [], 0.5)  # the waiter stays out while the adopter holds
    adopted.release()
    waiting.join(10)
    assert order == ["task-b"]


def test_an_expired_queued_lock_is_taken_by_the_next_contender(url: str) -> None:
    publish(ZooKeeperBackend(url), "short", "task-s", ttl=0.6)
    published = time.monotonic()
    contender = other(url)
    taken: list[Lease] = []

    def take() -> bool:
        try:
            taken.append(contender.acquire("short", holder="task-t"))
        except LockContended:
            return False
        return True

    until(take, 10, "the expired queued lock taken")
    assert time.monotonic() - published >= 0.55  # not before its ttl
    assert len(contender.queue("short")) == 1  # the expired node was deleted
    taken[0].release()


def test_a_waiter_behind_a_queued_lock_is_admitted_when_it_expires(url: str) -> None:
    publish(ZooKeeperBackend(url), "expire-wait", "task-s", ttl=1.0)
    published = time.monotonic()
    order: list[str] = []
    waiting = waiter(other(url), "expire-wait", order, "task-w")
    waiting.join(15)
    assert order == ["task-w"]
    assert time.monotonic() - published >= 0.95


def test_waiters_behind_a_queued_lock_are_admitted_in_order_after_adoption(url: str) -> None:
    publish(ZooKeeperBackend(url), "line", "task-q")
    watcher = other(url)
    order: list[str] = []
    tokens: list[int] = []
    threads = []
    for n in range(4):
        # each waiter on its own session, queued one after the other
        backend = ZooKeeperBackend(url.replace("timeout=4", f"timeout={5 + n}"))
        threads.append(waiter(backend, "line", order, f"w{n}", tokens))
        until(partial(queued, watcher, "line", n + 2), 10, f"waiter {n} queued")
    adopted = watcher.acquire("line", holder="task-q", takeover="task-q")
    assert [h.task_id for h in watcher.queue("line")] == ["task-q", "w0", "w1", "w2", "w3"]
    assert stays(lambda: order == [], 0.5)  # w0 watched the queued node: it listed again
    adopted.release()
    for thread in threads:
        thread.join(20)
    assert order == ["w0", "w1", "w2", "w3"]
    assert adopted.token < tokens[0] < tokens[1] < tokens[2] < tokens[3]


def test_no_two_holders_among_random_publishes_adoptions_and_waiters(url: str) -> None:
    """Random interleavings of publishers, adopting workers and plain contenders on one key:
    at no time do two of them act as holders (a queued lock is held by no running body), and
    their fencing tokens strictly increase in the order they held the key."""
    rng = random.Random(20261125)
    inside = 0
    overlaps = 0
    entered = 0
    guard = threading.Lock()
    published: list[str] = []
    held_tokens: list[int] = []  # in the order the holders got the key

    def body(lease: Lease) -> None:
        nonlocal inside, overlaps, entered
        with guard:
            inside += 1
            entered += 1
            overlaps += inside > 1
            held_tokens.append(lease.token)
        time.sleep(rng.random() * 0.003)  # hold it a little: widen any window for an overlap
        with guard:
            inside -= 1
        lease.release()

    def actor(seed: int) -> None:
        local = random.Random(seed)
        backend = ZooKeeperBackend(url.replace("timeout=4", f"timeout={4 + seed % 5}"))
        for step in range(12):
            roll = local.random()
            task = f"t{seed}-{step}"
            if roll < 0.35:
                try:
                    publish(backend, "mixed", task, ttl=local.choice([0.3, 5.0]))
                    with guard:
                        published.append(task)
                except LockContended:
                    pass
            else:
                with guard:  # an execution of a published task, or a plain contender
                    adoptable = published.pop() if published and roll < 0.7 else None
                try:
                    lease = backend.acquire(
                        "mixed",
                        holder=adoptable or task,
                        takeover=adoptable,
                        wait=local.random() * 0.5,
                    )
                except LockContended:
                    continue
                body(lease)

    threads = [threading.Thread(target=actor, args=(rng.randrange(10**6),)) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert entered > 5  # the run did exercise the lock
    assert overlaps == 0
    assert held_tokens == sorted(held_tokens)
    assert len(set(held_tokens)) == len(held_tokens)  # strictly increasing


# -- hand-over to a retry -----------------------------------------------------------------------


def test_hand_over_keeps_the_place_in_line_until_the_retry_adopts_it(url: str) -> None:
    backend = ZooKeeperBackend(url)
    running = backend.acquire("retry", holder="task-r")
    watcher = other(url)
    order: list[str] = []
    tokens: list[int] = []
    waiting = waiter(other(url), "retry", order, "task-w", tokens)
    until(partial(queued, watcher, "retry", 2), 10, "the waiter queued")
    nonce = backend.hand_over(running, 30)
    assert nonce is not None
    holder = watcher.holder("retry")
    assert holder is not None
    assert (holder.task_id, holder.queued, holder.nonce) == ("task-r", True, nonce)
    assert holder.fence > running.token  # a later node: a larger sequence number
    assert running.released
    assert stays(lambda: order == [], 0.5)  # the waiter listed again and found the queued lock
    retried = other(url).acquire("retry", holder="task-r", takeover="task-r")
    assert retried.token > holder.fence
    assert [h.task_id for h in watcher.queue("retry")] == ["task-r", "task-w"]
    assert stays(lambda: order == [], 0.3)
    retried.release()
    waiting.join(10)
    assert order == ["task-w"]
    # The waiter's node is older than the retry's, yet it holds later: a larger token.
    assert tokens[0] > retried.token


def test_a_handed_over_key_outlives_the_process_and_its_nonce_frees_it(url: str) -> None:
    nonce = in_other_process(
        url,
        "lease = b.acquire('handed', holder='task-h')\nprint(b.hand_over(lease, 30))",
    )
    backend = other(url)
    holder = backend.holder("handed")
    assert holder is not None
    assert (holder.task_id, holder.queued, holder.nonce) == ("task-h", True, nonce)
    with pytest.raises(LockContended):
        backend.acquire("handed", holder="task-x")
    # A worker discarding the retry message (revoked) frees the queued lock by its nonce.
    assert backend.release_nonce("handed", nonce)
    assert backend.holder("handed") is None


def test_hand_over_of_a_lease_no_longer_held_returns_none(url: str) -> None:
    backend = ZooKeeperBackend(url)
    lease = backend.acquire("gone", holder="task-g")
    holder = backend.holder("gone")
    assert holder is not None
    assert other(url).force_release("gone", holder)
    until(lambda: lease.lost, 10, "the holder told of the forced release")
    assert backend.hand_over(lease, 30) is None
    assert backend.holder("gone") is None


# -- forgotten leases (beat tick keys) ----------------------------------------------------------


def test_a_forgotten_lease_outlives_its_process_for_its_ttl_and_no_longer(url: str) -> None:
    out = in_other_process(
        url,
        "import time\nlease = b.acquire('tick', ttl=2, holder='beat-1')\nb.forget(lease)\n"
        "print(time.time())",
    )
    acquired = float(out)  # after the acquisition: its ttl ends no earlier than this + 2 s
    backend = other(url)
    with pytest.raises(LockContended) as caught:  # the beat and its session are gone
        backend.acquire("tick", holder="beat-2")
    assert caught.value.holder is not None
    assert caught.value.holder.task_id == "beat-1"
    taken: list[Lease] = []

    def take() -> bool:
        try:
            taken.append(backend.acquire("tick", holder="beat-2"))
        except LockContended:
            return False
        return True

    until(take, 10, "the tick key free after its ttl")
    assert time.time() - acquired >= 2.0 - 0.35  # the acquisition was up to the print earlier
    assert len(backend.queue("tick")) == 1


def test_a_forgotten_lease_keeps_its_place_ahead_of_a_waiter(url: str) -> None:
    backend = ZooKeeperBackend(url)
    lease = backend.acquire("tick-line", ttl=1.0, holder="beat-1")
    order: list[str] = []
    waiting = waiter(other(url), "tick-line", order, "beat-2")
    until(partial(queued, backend, "tick-line", 2), 10, "the waiter queued")
    backend.forget(lease)
    forgotten = time.monotonic()
    assert [h.task_id for h in backend.queue("tick-line")] == ["beat-1", "beat-2"]
    waiting.join(15)
    assert order == ["beat-2"]
    assert time.monotonic() - forgotten >= 0.5  # it waited out (most of) the ttl


# -- enqueue-time mode with a real worker -------------------------------------------------------


@pytest.fixture(scope="module")
def zk_celery(zk: ZkServer, celery_base: str) -> Iterator[tuple[Any, Journal, str]]:
    """A ``celery worker`` (tests.support.worker_app) whose locks are on ZooKeeper, the test
    process's copy of the app pointed at the same servers, its journal, the lock URL. The
    environment is only the worker's: nothing leaks to other modules' workers."""
    zk_url = f"zookeeper://{zk.hosts}/celery-{uuid.uuid4().hex[:8]}?timeout=4"
    env = {**make_mode("zk", celery_base).env, "DLOCK_TEST_LOCK_URL": zk_url}
    from tests.support import worker_app

    point_at_broker(worker_app.app, env["DLOCK_TEST_BROKER"])
    worker_app.app.conf.result_backend = env["DLOCK_TEST_BACKEND"]
    use_lock_urls(worker_app.app, [zk_url])
    journal = Journal(env["DLOCK_TEST_JOURNAL"])
    journal.clear()
    worker = Worker(env, journal, name="zk", app="tests.support.zk_worker_app").start()
    try:
        yield worker_app, journal, zk_url
    finally:
        # Results of merged publishes unsubscribe when collected: while Redis still runs.
        gc.collect()
        worker.stop()
        close_all()


def test_enqueue_mode_on_zookeeper_merges_duplicates_and_frees_the_key(
    zk_celery: tuple[Any, Journal, str],
) -> None:
    wa, journal, _ = zk_celery
    manager = wa.enqueued._dlock().manager
    assert isinstance(manager, ZooKeeperBackend)
    results = submit_concurrently(wa.enqueued.delay, [(("zk-queued", 1.0), {})] * 10)
    assert len({r.id for r in results}) == 1  # every duplicate got the queued task's result
    key = wa.enqueued.lock_key_for(("zk-queued", 1.0), {})
    assert results[0].get(timeout=20) == "zk-queued"
    assert len(journal.select("start", name="zk-queued")) == 1
    until(lambda: manager.holder(key) is None, 10, "the key free after the run")
    assert manager.queue(key) == []  # no timed node left behind


def test_enqueue_mode_retry_on_zookeeper_hands_the_key_to_the_retry(
    zk_celery: tuple[Any, Journal, str],
) -> None:
    wa, journal, _ = zk_celery
    manager = wa.enqueued_flaky._dlock().manager
    # The countdown bounds how long the test can look at the hand-over, so it is long enough
    # for a loaded host to get from the body's end (journalled before retry() publishes) to
    # the hand-over.
    countdown = 8.0
    result = wa.enqueued_flaky.delay("zk-kept", countdown)
    journal.wait_for("end", name="zk-kept")
    key = wa.enqueued_flaky.lock_key_for(("zk-kept", countdown), {})

    def handed_over() -> bool:
        holder = manager.holder(key)
        return holder is not None and holder.queued

    until(handed_over, countdown, "the key handed to the retry message")
    # During the countdown the key belongs to the retry message: duplicates map to it.
    assert wa.enqueued_flaky.delay("zk-kept", countdown).id == result.id
    holder = manager.holder(key)
    assert holder is not None
    assert (holder.task_id, holder.queued) == (result.id, True)
    assert result.get(timeout=countdown + 20) == 1
    assert [s["retries"] for s in journal.select("start", name="zk-kept")] == [0, 1]
    until(lambda: manager.holder(key) is None, 10, "the key free after the retry ran")


# -- no accumulation ----------------------------------------------------------------------------


def test_a_keys_parent_is_a_container_the_servers_delete_once_empty(url: str) -> None:
    """Keys used once leave nothing behind (the test servers check containers every 0.5 s)."""
    backend = ZooKeeperBackend(url)
    client = backend.shared.start()
    parent = backend.parent("once")
    lease = backend.acquire("once", holder="task-1")
    assert client.exists(parent) is not None  # (a container's stat shows no mark of it)
    lease.release()
    until(lambda: client.exists(parent) is None, 10, "the empty parent deleted")
    again = backend.acquire("once", holder="task-2")  # the parent is made again
    assert backend.holder("once") is not None
    again.release()


def test_an_expired_timed_node_is_deleted_by_an_inspection(url: str) -> None:
    publish(ZooKeeperBackend(url), "left", "task-l", ttl=0.3)
    operator = other(url)
    until(lambda: operator.holder("left") is None, 10, "the expired queued lock seen as free")
    assert operator.queue("left") == []  # deleted, not only ignored


# -- a three-node ensemble ------------------------------------------------------------------------


@pytest.mark.slow
def test_queued_locks_survive_a_leader_change_then_expire_or_are_adopted() -> None:
    """Timed nodes are ensemble state like any other: a new leader keeps them, and their
    expiry is measured on its clock (one machine here: the clocks agree)."""
    with ensemble(3) as group:
        url = f"zookeeper://{group.hosts}/eq-{uuid.uuid4().hex[:8]}?timeout=6"
        token = int(
            in_other_process(
                url,
                "p = b.send_queued('kept', 60, holder='task-k')\n"
                "lease = p.finish()\nb.forget(lease)\nprint(lease.token)",
            )
        )
        publish(ZooKeeperBackend(url), "brief", "task-b", ttl=2.0)
        published = time.monotonic()
        group.leader().stop(kill=True)
        assert group.leader().running
        backend = other(url.replace("timeout=6", "timeout=4"))
        until(lambda: _serving(backend), 30, "the ensemble serving again")
        holder = backend.holder("kept")
        assert holder is not None
        assert (holder.task_id, holder.queued, holder.fence) == ("task-k", True, token)
        adopted = backend.acquire("kept", holder="task-k", takeover="task-k")
        assert adopted.token > token
        adopted.release()
        brief = backend.acquire("brief", holder="task-n", wait=30)  # waits for its expiry
        assert time.monotonic() - published >= 1.95
        brief.release()
        close_all()


def _serving(backend: ZooKeeperBackend) -> bool:
    try:
        backend.holder("probe")
    except Exception:
        return False
    return True


def test_a_refusal_racing_a_forget_still_names_the_holder(url: str) -> None:
    """Two beats claim one tick: the first forgets its lease (its node replaced by a timed
    one) just as the second's refusal reads the first node: the refusal looks again and
    names the holder, instead of saying nobody (beat would then send the tick twice)."""
    first = ZooKeeperBackend(url)
    lease = first.acquire("tick-race", ttl=5, holder="beat-1")
    second = other(url)
    client = second.shared.start()
    real_call = client._call
    forgot: list[bool] = []

    def interleave(request: Any, async_object: Any) -> Any:
        # Right before the second's read of the holder's node: the first forgets its lease.
        if type(request).__name__ == "GetData" and not forgot:
            forgot.append(True)
            first.forget(lease)
        return real_call(request, async_object)

    client._call = interleave
    try:
        with pytest.raises(LockContended) as caught:
            second.acquire("tick-race", holder="beat-2")
    finally:
        del client._call
    assert forgot
    assert caught.value.holder is not None
    assert caught.value.holder.task_id == "beat-1"
    assert [h.task_id for h in second.queue("tick-race")] == ["beat-1"]


def test_a_refusal_whose_head_keeps_vanishing_leaves_no_node_in_line(url: str) -> None:
    """The holder's node is replaced (as a hand-over or forget does) right before each read of
    it by another's refusal, more often than the refusal tries again: the refusal gives up
    without making one more node it would never read nor delete (that node would wait in line,
    then hold the key with no lease, for as long as this process's session lives)."""
    first = ZooKeeperBackend(url)
    first.acquire("vanishing", holder="holder-1")
    second = other(url)
    client = second.shared.start()
    replacer = first.shared.start()
    real_call = client._call
    (head,) = replacer.get_children(first.parent("vanishing"))
    heads = [f"{first.parent('vanishing')}/{head}"]

    def replace_head(request: Any, async_object: Any) -> Any:
        # Right before the refusal reads the holder's node: that node is replaced, in one
        # transaction, by a session node in its place in line (its order), as a replacement is.
        if type(request).__name__ == "GetData" and request.path == heads[-1]:
            parent, name = heads[-1].rsplit("/", 1)
            parsed = parse_name(name)
            assert parsed is not None
            data, _ = replacer.get(heads[-1])
            transaction = replacer.transaction()
            replacement = f"{parent}/{parsed.nonce}~o{parsed.order:010d}-"
            transaction.create(replacement, data, ephemeral=True, sequence=True)
            transaction.delete(heads[-1])
            created, _ = transaction.commit()
            heads.append(created)
        return real_call(request, async_object)

    client._call = replace_head
    try:
        with pytest.raises(LockContended):
            second.acquire("vanishing", holder="refused-2")
    finally:
        del client._call
    assert len(heads) > 2  # the head vanished under more than one attempt
    assert [h.task_id for h in second.queue("vanishing")] == ["holder-1"]
