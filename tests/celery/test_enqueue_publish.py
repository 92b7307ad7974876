"""Enqueue-time mode at publish: the queued lock's acquisition is sent before Celery builds the
message and read in ``before_task_publish``. Real broker and lock servers, no worker: these are
about what a publisher sends (the worker side is in test_singleton.py)."""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_dlock import SingletonTask
from celery_dlock.backends.redis.janitor import janitor
from celery_dlock.celery import enqueue, senders
from celery_dlock.celery.headers import HEADER_QUEUED
from celery_dlock.core.holder import head_nonce, value_head
from celery_dlock.testing import RedisServer, free_port
from tests.support.clients import client
from tests.support.proxy import FaultProxy


def publisher(
    broker: str,
    lock_urls: list[str],
    name: str,
    backend: str | None = "broker",
    task_name: str | None = None,
) -> tuple[Celery, Any]:
    """An app publishing to ``broker`` with one enqueue-time task (``<name>.job`` unless
    ``task_name``), locked on ``lock_urls``."""
    backend = broker if backend == "broker" else backend
    app = Celery(name, broker=broker, backend=backend, set_as_current=False)
    app.conf.dlock_urls = lock_urls
    app.conf.broker_connection_retry = False
    app.conf.broker_connection_max_retries = 0
    app.conf.task_publish_retry = False

    @app.task(base=SingletonTask, shared=False, name=task_name or f"{name}.job", lock_on="enqueue")
    def job(n: int) -> int:
        return n

    return app, job


@pytest.fixture
def own_servers(servers: list[RedisServer]) -> Iterator[list[RedisServer]]:
    """Six servers of this test's own, with its garbage collected before they stop: a sent
    message's AsyncResult can sit in a reference cycle, and collected once its result Redis
    is gone, its unsubscribe fails in ``__del__`` and pytest blames whichever test runs then."""
    yield servers
    gc.collect()


@pytest.fixture
def enqueue_app(single_urls: list[str]) -> Iterator[tuple[Celery, Any]]:
    app, job = publisher(single_urls[0], single_urls, "early")
    enqueue._held_recently.clear()  # every publish below takes the early path
    yield app, job
    app.close()


def queued_messages(app: Celery) -> list[dict[str, Any]]:
    raw = client(app.conf.broker_url).lrange("celery", 0, -1)
    return [json.loads(m) for m in raw]


def test_a_duplicate_found_at_publish_is_not_published(
    enqueue_app: tuple[Celery, Any],
) -> None:
    app, job = enqueue_app
    first = job.apply_async((1,), task_id="first")
    assert [m["headers"]["id"] for m in queued_messages(app)] == ["first"]
    # The message names its queued lock's acquisition (its token), for a worker discarding it.
    holder = job._dlock().manager.holder(job.lock_key_for((1,), {}))
    assert queued_messages(app)[0]["headers"][HEADER_QUEUED] == holder.nonce
    enqueue._held_recently.clear()  # so the duplicate, too, is read at publish

    duplicate = job.apply_async((1,), task_id="second")

    assert duplicate.id == first.id == "first"
    assert [m["headers"]["id"] for m in queued_messages(app)] == ["first"]
    # Celery subscribed to the called-off message's result before publishing; undone.
    assert app.backend.get_key_for_task("second") not in app.backend.result_consumer.subscribed_to


def test_a_publish_that_fails_after_the_acquisition_frees_the_key(
    single_urls: list[str],
) -> None:
    app, job = publisher(f"redis://127.0.0.1:{free_port()}/0", single_urls, "nobroker", None)
    enqueue._held_recently.clear()
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever the broker client raises
        job.delay(7)
    manager = job._dlock().manager
    assert manager.holder(job.lock_key_for((7,), {})) is None
    assert enqueue._early_locks() == {}
    app.close()


def test_lock_redis_unreachable_publishes_without_a_queued_lock(
    single_urls: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    dead = [f"redis://127.0.0.1:{free_port()}/0"]
    app, job = publisher(single_urls[0], dead, "nolock", backend=None)
    enqueue._held_recently.clear()
    with caplog.at_level(logging.WARNING, logger="celery_dlock.task"):
        result = job.delay(3)
    assert [m["headers"]["id"] for m in queued_messages(app)] == [result.id]
    assert any("published without its queued lock" in r.getMessage() for r in caplog.records)
    app.close()


def test_many_distinct_keys_each_hold_their_queued_lock(
    enqueue_app: tuple[Celery, Any],
) -> None:
    app, job = enqueue_app
    results = [job.delay(n) for n in range(50)]
    manager = job._dlock().manager
    for n, result in enumerate(results):
        holder = manager.holder(job.lock_key_for((n,), {}))
        assert holder is not None
        assert holder.queued
        assert holder.task_id == result.id
    assert len(queued_messages(app)) == 50


# -- Redlock: a duplicate merged into an attempt that its publisher then undid ---------------


def test_a_redlock_duplicate_never_merges_into_an_undone_attempt(
    single_urls: list[str], own_servers: list[RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Publisher A's attempt takes nodes 1 and 2 of three, but node 2's reply comes after
    # A's dlock_node_timeout and node 3 refuses (another value there): A sees no majority
    # and undoes its attempt. Publisher B, reading the nodes meanwhile, saw A's value on a
    # majority and used to merge into A's task id at once. A then tries again with a new
    # nonce and finds publisher C holding the key (C published the moment A undid): A merges
    # into C and never publishes its own id, so B's result never came.
    nodes = own_servers[:3]
    task = "race.job"
    with FaultProxy(nodes[1].port) as proxy:
        urls_a = [nodes[0].url, proxy.url, nodes[2].url]
        direct = [n.url for n in nodes]
        app_a, job_a = publisher(single_urls[0], urls_a, "race_a", task_name=task)
        app_b, job_b = publisher(single_urls[0], direct, "race_b", task_name=task)
        app_c, job_c = publisher(single_urls[0], direct, "race_c", task_name=task)
        for app in (app_a, app_b, app_c):
            app.conf.dlock_node_timeout = 0.5
        key = job_a.lock_key_for((1,), {})
        redis_key = f"dlock:{{{key}}}"
        manager_a = job_a._dlock().manager
        for job in (job_b, job_c):  # this thread's connections open before the race starts
            assert job._dlock().manager.holder(key) is None
        client(nodes[2].url).set(redis_key, b"another value", px=60_000)

        published: dict[str, Any] = {}
        undo = manager_a._undo

        def undo_then_c_publishes(*args: Any) -> None:
            # A's first undo is the moment C publishes: the key is free on node 1 again.
            undo(*args)
            if "c" not in published:
                client(nodes[2].url).delete(redis_key)
                publishing = threading.Thread(
                    target=lambda: published.setdefault("c", job_c.apply_async((1,), task_id="C"))
                )
                publishing.start()
                publishing.join(timeout=10)

        monkeypatch.setattr(manager_a, "_undo", undo_then_c_publishes)
        warmed, delayed = threading.Event(), threading.Event()

        def publish_a() -> None:
            # Each thread has its own connections: A's open (and the acquire script is loaded
            # on every node) before node 2 turns slow.
            manager_a.release(manager_a.acquire("warm-up", renew=False))
            warmed.set()
            assert delayed.wait(timeout=10)
            published["a"] = job_a.apply_async((1,), task_id="A")

        a = threading.Thread(target=publish_a)
        a.start()
        assert warmed.wait(timeout=10)
        proxy.delay(2.0)  # node 2's replies to A come long after A's node timeout
        delayed.set()
        deadline = time.monotonic() + 5
        while not all(b'"A"' in (client(n.url).get(redis_key) or b"") for n in nodes[:2]):
            assert time.monotonic() < deadline, "A's attempt never reached nodes 1 and 2"
        # A's value is on a majority; A is still waiting for node 2's reply.
        b = job_b.apply_async((1,), task_id="B")
        a.join(timeout=30)
        proxy.heal()  # A's voids of node 2 land (the janitor sends them again until they do)
        sent = [m["headers"]["id"] for m in queued_messages(app_a)]
        assert sent == ["C"], sent
        assert published["a"].id == "C"  # A merged into C: its own id was never published
        assert b.id in sent, f"B merged into {b.id}, which was never published"
        for app in (app_a, app_b, app_c):
            app.close()


def test_a_redlock_duplicate_waits_only_while_the_holder_may_still_be_undone(
    single_urls: list[str], redlock_urls: list[str]
) -> None:
    # A queued holder younger than settle_time is read again until it settles, then merged;
    # once it is older, a duplicate merges at once (one acquisition round, no wait).
    app, job = publisher(single_urls[0], redlock_urls, "settle")
    app.conf.dlock_node_timeout = 0.2
    manager = job._dlock().manager
    assert manager.settle_time == pytest.approx(0.6)
    first = job.apply_async((2,))
    assert job.apply_async((2,)).id == first.id
    holder = manager.holder(job.lock_key_for((2,), {}))
    assert holder is not None
    assert time.time() - holder.since >= manager.settle_time  # the duplicate waited for it
    started = time.monotonic()
    assert job.apply_async((2,)).id == first.id
    assert time.monotonic() - started < manager.settle_time / 2
    assert [m["headers"]["id"] for m in queued_messages(app)] == [first.id]
    app.close()


# -- send_task by name with several apps registering the task ---------------------------------


@pytest.fixture
def twin_apps(own_servers: list[RedisServer]) -> Iterator[list[tuple[Celery, Any]]]:
    """Two apps in this process, each with its own broker and lock Redis, registering the
    same enqueue-time task name (as a shared task copied into both would be)."""
    twins = [
        publisher(own_servers[2 + i].url, [own_servers[i].url], f"twin{i}", task_name="twin.job")
        for i in range(2)
    ]
    for _, job in twins:
        assert job.name == "twin.job"  # binds the task: each app registers the name
    yield twins
    for app, _ in twins:
        app.close()


def test_send_task_by_name_is_locked_with_the_sending_apps_settings(
    twin_apps: list[tuple[Celery, Any]],
) -> None:
    # The receiver used the app that registered the name first, so the second app's
    # messages took their queued locks on the first app's lock Redis.
    (first_app, first_job), (second_app, second_job) = twin_apps
    key = second_job.lock_key_for((5,), {})
    sent = second_app.send_task("twin.job", (5,))
    holder = second_job._dlock().manager.holder(key)
    assert holder is not None
    assert holder.task_id == sent.id
    assert first_job._dlock().manager.holder(key) is None
    again = second_app.send_task("twin.job", (5,))
    headers = {m["headers"]["id"]: m["headers"] for m in queued_messages(second_app)}
    assert headers[again.id]["dlock_duplicate_of"] == sent.id
    # The first app's own sends lock on its own Redis, apart from the second's.
    mine = first_app.send_task("twin.job", (5,))
    holder = first_job._dlock().manager.holder(key)
    assert holder is not None
    assert holder.task_id == mine.id
    assert [m["headers"]["id"] for m in queued_messages(first_app)] == [mine.id]


def test_send_task_by_name_that_names_no_sending_app_is_not_locked_and_says_why(
    twin_apps: list[tuple[Celery, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    # A reply_to of the caller's own hides which app sends: neither app's settings are
    # guessed; the message goes out without a queued lock, with a warning naming both apps.
    (first_app, first_job), (second_app, second_job) = twin_apps
    senders._ambiguous_warned.clear()
    key = second_job.lock_key_for((6,), {})
    with caplog.at_level(logging.WARNING, logger="celery_dlock.task"):
        sent = second_app.send_task("twin.job", (6,), reply_to="my-own-queue")
    assert first_job._dlock().manager.holder(key) is None
    assert second_job._dlock().manager.holder(key) is None
    message = queued_messages(second_app)[0]
    assert message["headers"]["id"] == sent.id
    assert "dlock_duplicate_of" not in message["headers"]
    warned = [r.getMessage() for r in caplog.records if "sent by name" in r.getMessage()]
    assert len(warned) == 1
    assert repr(first_app) in warned[0]
    assert repr(second_app) in warned[0]


@pytest.mark.parametrize("results", [None, "rpc://"])
def test_a_redlock_duplicate_of_a_task_without_kept_results_merges_at_once(
    single_urls: list[str],
    redlock_urls: list[str],
    monkeypatch: pytest.MonkeyPatch,
    results: str | None,
) -> None:
    # With no result backend nobody can wait on a merged task id, so waiting for the holder to
    # settle protects nothing; and a holder that a worker ran and released before the duplicate
    # read the key again could not be told from an undone attempt (its state stays PENDING):
    # the duplicate published a second message, so one call ran twice. The rpc:// backend is
    # the same for any other publisher: a result goes to the reply queue of the one that sent
    # the task, and reads PENDING everywhere else.
    app, job = publisher(single_urls[0], redlock_urls, "unkept", backend=results)
    app.conf.dlock_node_timeout = 0.5
    manager = job._dlock().manager
    key = job.lock_key_for((4,), {})
    first = job.apply_async((4,))
    holder = manager.holder(key)
    assert holder is not None
    assert holder.queued
    assert time.time() - holder.since < manager.settle_time  # young: not settled yet
    read = manager.holder
    ran: list[bool] = []

    def worker_ran_meanwhile(k: str) -> Any:
        # A worker takes the queued message's lock over, runs the task and releases the key,
        # right after the duplicate found it queued (a fast task on an idle worker).
        if not ran:
            ran.append(True)
            manager.release(manager.acquire(key, holder=first.id, takeover=first.id))
        return read(k)

    monkeypatch.setattr(manager, "holder", worker_ran_meanwhile)
    started = time.monotonic()
    duplicate = job.apply_async((4,))
    waited = time.monotonic() - started
    assert duplicate.id == first.id
    assert [m["headers"]["id"] for m in queued_messages(app)] == [first.id]
    assert waited < manager.settle_time / 2
    app.close()


def test_send_task_with_a_reply_to_of_its_own_is_locked_when_one_app_registers_the_task(
    own_servers: list[RedisServer],
) -> None:
    # One app registering the name leaves nothing to tell apart: the caller's reply_to (an RPC
    # reply queue of its own) must not cost the message its queued lock.
    app, job = publisher(own_servers[2].url, [own_servers[0].url], "lone", task_name="lone.job")
    assert job.name == "lone.job"  # binds the task: the app registers the name
    key = job.lock_key_for((7,), {})
    sent = app.send_task("lone.job", (7,), reply_to="my-own-queue")
    holder = job._dlock().manager.holder(key)
    assert holder is not None
    assert holder.task_id == sent.id
    again = app.send_task("lone.job", (7,), reply_to="my-own-queue")
    headers = {m["headers"]["id"]: m["headers"] for m in queued_messages(app)}
    assert headers[again.id]["dlock_duplicate_of"] == sent.id
    app.close()


def test_send_task_by_name_from_another_thread_is_locked_with_the_sending_apps_settings(
    twin_apps: list[tuple[Celery, Any]],
) -> None:
    # An app's thread_oid is per thread: a send from a second thread carries that thread's,
    # which the receiver (in the same thread) reads from the same app.
    (_first_app, first_job), (second_app, second_job) = twin_apps
    key = second_job.lock_key_for((8,), {})
    assert second_app.thread_oid  # this thread's oid exists before the other thread's send
    sent: list[Any] = []
    sending = threading.Thread(target=lambda: sent.append(second_app.send_task("twin.job", (8,))))
    sending.start()
    sending.join(timeout=10)
    holder = second_job._dlock().manager.holder(key)
    assert holder is not None
    assert holder.task_id == sent[0].id
    assert first_job._dlock().manager.holder(key) is None


def test_a_redlock_duplicate_merges_into_a_holder_that_ran_before_its_result_was_stored(
    single_urls: list[str], redlock_urls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker releases the key as the body returns and stores the result after that (Celery's
    # tracer), so a fast task is gone from the key while its state still reads PENDING. A
    # duplicate that found it queued and read its state in that gap took it for an undone
    # attempt and published a second message: one call ran twice.
    app, job = publisher(single_urls[0], redlock_urls, "gap")
    app.conf.dlock_node_timeout = 0.5
    manager = job._dlock().manager
    key = job.lock_key_for((5,), {})
    first = job.apply_async((5,))
    read, ran = manager.holder, enqueue._ran
    stored: list[bool] = []

    def worker_ran_meanwhile(k: str) -> Any:
        # The worker takes the queued lock over, runs the body and releases the key, right
        # after the duplicate found it queued; its result is not stored yet.
        if not stored:
            manager.release(manager.acquire(key, holder=first.id, takeover=first.id))
        return read(k)

    def result_stored_after_the_first_look(task: Any, task_id: str | None) -> bool:
        seen = ran(task, task_id)
        if not stored:  # the worker stores the result right after this first read
            stored.append(seen)
            with warnings.catch_warnings():  # Celery's Redis result backend calls setex
                warnings.simplefilter("ignore", DeprecationWarning)
                app.backend.store_result(first.id, 5, "SUCCESS")
        return seen

    monkeypatch.setattr(manager, "holder", worker_ran_meanwhile)
    monkeypatch.setattr(enqueue, "_ran", result_stored_after_the_first_look)
    duplicate = job.apply_async((5,))
    assert stored == [False]  # the duplicate did read the state in the gap
    assert duplicate.id == first.id
    assert [m["headers"]["id"] for m in queued_messages(app)] == [first.id]
    app.close()


def test_a_redlock_duplicate_of_a_holder_its_worker_is_taking_over_merges_at_once(
    single_urls: list[str], redlock_urls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A duplicate found the key queued, not settled, and read it again while a worker was taking
    # it over node by node: no value on a majority. It took the holder for gone and waited for
    # its state to leave PENDING, which a running task without track_started does only when its
    # run ends (CI: 24 duplicates blocked for the whole of a 4 s run). It reads the key again
    # and merges as soon as the execution holds it.
    app, job = publisher(single_urls[0], redlock_urls, "takeover")
    app.conf.dlock_node_timeout = 1.0
    manager = job._dlock().manager
    key = job.lock_key_for((6,), {})
    redis_key = f"dlock:{{{key}}}"
    nodes = [client(url) for url in redlock_urls]
    first = job.apply_async((6,))
    queued_value = nodes[0].get(redis_key)
    read = manager.holder
    reads: list[Any] = []
    taken: list[Any] = []  # the worker's leases, forgotten at the end (watched when anyone
    # listens for lost leases, as tests.support.worker_app does once another module imported it)

    def worker_taking_over(k: str) -> Any:
        # First look: the take-over reached nodes 3 and 4, node 5 has missed both values; then
        # it completes everywhere. The result state stays PENDING throughout (still running).
        if not reads:
            taken.append(manager.acquire(key, holder=first.id, takeover=first.id, renew=False))
            for n in nodes[:2]:
                n.set(redis_key, queued_value, px=60_000)
            nodes[4].delete(redis_key)
        elif len(reads) == 1:
            taken.append(manager.acquire(key, holder=first.id, takeover=first.id, renew=False))
        reads.append(read(k))
        return reads[-1]

    monkeypatch.setattr(manager, "holder", worker_taking_over)
    started = time.monotonic()
    duplicate = job.apply_async((6,))
    waited = time.monotonic() - started
    assert reads[0] is None  # the duplicate did read the key mid-take-over
    assert reads[-1] is not None
    assert not reads[-1].queued  # its execution holds the key
    assert duplicate.id == first.id
    assert [m["headers"]["id"] for m in queued_messages(app)] == [first.id]
    assert waited < manager.settle_time / 2, f"waited {waited:.2f} s of {manager.settle_time} s"
    for lease in taken:
        manager.forget(lease)
    app.close()


def janitor_idle(nodes: list[Any], server: Any, timeout: float = 10) -> None:
    """Wait until this process's janitor has nothing left to send to ``nodes``: none queued,
    and a void of its own, pushed then, has landed on ``nodes[0]`` (``server``: a client of
    the Redis behind it). The janitor serves one item at a time, so every item it took
    earlier was sent by then: the test's proxies may close without leaving it work for nodes
    that are gone (retried for minutes)."""
    deadline = time.monotonic() + timeout

    def queued() -> bool:  # the janitor's queue, read as the conftest reads the watchdog's
        return any(item.node in nodes for item in list(janitor._heap))

    while True:
        while queued():
            assert time.monotonic() < deadline, "the janitor still has work for these nodes"
            time.sleep(0.01)
        head = value_head(None)
        marker = f"dlock:{{idle}}:void:{head_nonce(head)}"
        janitor.void(nodes[:1], "dlock:{idle}", marker, head, time.monotonic() + 5)
        while not server.exists(marker):
            assert time.monotonic() < deadline, "the janitor's own void never landed"
            time.sleep(0.01)
        if not queued():
            return


@pytest.mark.parametrize(
    ("results", "how"), [("broker", "apply_async"), (None, "apply_async"), ("broker", "send_task")]
)
def test_a_redlock_publish_never_merges_into_its_own_undone_attempt(
    single_urls: list[str],
    own_servers: list[RedisServer],
    monkeypatch: pytest.MonkeyPatch,
    results: str | None,
    how: str,
) -> None:
    # A's attempt takes nodes 1 and 2, finds a foreign value on nodes 3 and 4, and takes node
    # 5, whose reply is cut: no majority, so A undoes it. The undo's releases to nodes 1 and 2
    # are lost with their connections, and the voids wait in this process's janitor behind a
    # hung node: the undone attempt still holds nodes 1, 2 and 5. A's next attempt found it
    # there, a queued lock of A's own task id, and merged into it: delay() returned the id of
    # a message never published (send_task published it marked a duplicate of itself, which
    # the worker drops): the call was lost.
    with (
        FaultProxy(own_servers[0].port) as p1,
        FaultProxy(own_servers[1].port) as p2,
        FaultProxy(own_servers[4].port) as p5,
        FaultProxy(own_servers[0].port) as hung,
    ):
        urls = [p1.url, p2.url, own_servers[2].url, own_servers[3].url, p5.url]
        app, job = publisher(single_urls[0], urls, "self", results)
        app.conf.dlock_node_timeout = 0.5
        stalled, stalled_job = publisher(single_urls[0], [hung.url], "stalled")
        stalled.conf.dlock_node_timeout = 8.0
        manager = job._dlock().manager
        key = job.lock_key_for((1,), {})
        manager.release(manager.acquire("warm-up", renew=False))  # connections open
        for foreign in own_servers[2:4]:
            client(foreign.url).set(f"dlock:{{{key}}}", b"another value", px=60_000)
        # The janitor serves one node at a time: a void for a hung node holds up the others
        # for that node's timeout (8 s here).
        hung.blackhole()
        until = time.monotonic() + 5
        hung_node = stalled_job._dlock().manager.nodes[0]
        janitor.void([hung_node], "dlock:{hung}", "dlock:{hung}:void:x", value_head(None), until)
        deadline = time.monotonic() + 5
        while not any(pair.to_up for pair in hung.open_pairs()):
            assert time.monotonic() < deadline, "the janitor never reached the hung node"
            time.sleep(0.01)
        undo = manager._undo

        undos: list[bool] = []

        def releases_lost(*args: Any) -> None:
            if not undos:  # the first attempt's undo: its releases are dropped with their
                p1.swallow()  # connections
                p2.swallow()
            undos.append(True)
            undo(*args)

        monkeypatch.setattr(manager, "_undo", releases_lost)
        p5.reset_mid_reply()  # node 5 takes A's attempt; its reply is cut
        try:
            if how == "send_task":
                result = app.send_task(job.name, (1,), task_id="A")
            else:
                result = job.apply_async((1,), task_id="A")
            assert p5.cut.is_set()
            assert p1.swallowed.is_set()
            assert p2.swallowed.is_set()
            messages = queued_messages(app)
            assert [m["headers"]["id"] for m in messages] == ["A"], f"A merged into {result.id}"
            assert result.id == "A"
            assert "dlock_duplicate_of" not in messages[0]["headers"]
        finally:
            hung.heal()
            janitor_idle([hung_node, *manager.nodes], client(own_servers[0].url))
            stalled.close()
            app.close()


def test_a_redlock_publish_that_finds_no_majority_holder_says_it_went_out_unlocked(
    single_urls: list[str], redlock_urls: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    # Two values that are not ours hold two nodes each: every attempt takes one node, nobody
    # has a majority, and the look-again budget for colliding contenders runs out. The message
    # goes out without its queued lock, which a publish logs in every other such case; here it
    # said nothing, so an operator could not tell why a duplicate was published.
    app, job = publisher(single_urls[0], redlock_urls, "split")
    key = job.lock_key_for((3,), {})
    for i, url in enumerate(redlock_urls[:4]):
        client(url).set(f"dlock:{{{key}}}", b"value x" if i < 2 else b"value y", px=60_000)
    with caplog.at_level(logging.WARNING, logger="celery_dlock.task"):
        result = job.apply_async((3,))
    assert [m["headers"]["id"] for m in queued_messages(app)] == [result.id]
    warned = [r.getMessage() for r in caplog.records if "without its queued lock" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "no majority" in warned[0]
    app.close()
