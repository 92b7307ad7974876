"""Fixtures for tests with real ``celery worker`` processes: one broker Redis, a mode (single
Redis or Redlock-5 for the locks), the test process's copy of ``tests.support.worker_app``, a
journal, and a module-scoped worker."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from celery_dlock.core import registry
from tests.support.clients import client
from tests.support.workers import Journal, Worker, use_lock_urls

#: Session timeout (seconds) of the zookeeper mode's clients, workers and beats.
ZK_SESSION = 3


@dataclass
class Mode:
    name: str
    lock_urls: list[str]
    env: dict[str, str]

    @property
    def zookeeper(self) -> bool:
        return self.name == "zookeeper"

    def clear_locks(self) -> None:
        """Empty the lock store (FLUSHDB on each Redis; the chroot on ZooKeeper)."""
        if self.zookeeper:
            from celery_dlock.backends.zookeeper import parse
            from tests.support.zookeeper import wipe

            url = parse(self.lock_urls[0])
            wipe(url.connect_string, url.chroot)
            return
        for url in self.lock_urls:
            client(url).flushdb()

    def delete_lock(self, key: str) -> None:
        """Delete ``key``'s lock behind its holder's back (a DEL of the Redis key on every
        node; on ZooKeeper a delete of the holder's node by a client of our own)."""
        if self.zookeeper:
            from tests.support.zookeeper import delete_holder

            assert delete_holder(self.lock_urls[0], key), f"nobody held {key!r}"
            return
        for url in self.lock_urls:
            client(url).delete(f"dlock:{{{key}}}")


def with_db(url: str, db: int) -> str:
    base = url.rsplit("/", 1)[0] if url.count("/") >= 3 else url
    return f"{base}/{db}"


@pytest.fixture(scope="session")
def celery_base(single_session_urls: list[str]) -> str:
    """The Redis that carries the broker (db 10), results (11), single locks (12), journal (13)."""
    return single_session_urls[0]


def make_mode(
    name: str,
    celery_base: str,
    redlock_urls: list[str] | None = None,
    *,
    lock_urls: list[str] | None = None,
) -> Mode:
    """Mode ``name``: locks on db 12 of ``celery_base`` ("single"), on ``redlock_urls``, or
    on ``lock_urls`` (ZooKeeper: one standalone server's URL, so without commas)."""
    if lock_urls is None:
        lock_urls = [with_db(celery_base, 12)] if redlock_urls is None else redlock_urls
    env = {
        "DLOCK_TEST_BROKER": with_db(celery_base, 10),
        "DLOCK_TEST_BACKEND": with_db(celery_base, 11),
        "DLOCK_TEST_JOURNAL": with_db(celery_base, 13),
        "DLOCK_TEST_LOCK_URLS": ",".join(lock_urls),
    }
    return Mode(name, lock_urls, env)


@pytest.fixture(scope="module", params=["single", "redlock5", "zookeeper"])
def mode(request: pytest.FixtureRequest, celery_base: str) -> Mode:
    """The lock store of a module's workers; "zookeeper" only in modules whose ``MODES``
    lists it (tests/conftest.py drops it elsewhere)."""
    if request.param == "single":
        return make_mode("single", celery_base)
    if request.param == "zookeeper":
        url = request.getfixturevalue("zookeeper_session_url")
        # A ZooKeeper lock lasts as long as its holder's session: a 3 s session timeout plays
        # the part of the worker tasks' lock_ttl of 3 s (a dead holder's key frees after it).
        return make_mode("zookeeper", celery_base, lock_urls=[f"{url}?timeout={ZK_SESSION}"])
    return make_mode("redlock5", celery_base, request.getfixturevalue("redlock_session_urls"))


def point_at_broker(app: Any, url: str) -> None:
    """Point ``app`` (a test process's copy of an app that several modules share) at the
    broker ``url``, dropping every connection to the one it used before.

    Always, not only when ``broker_url`` differs: a module may have set the setting without
    touching the pools (so the setting matches while the pools still hold another broker's
    connections, e.g. RabbitMQ's after a RabbitMQ pass: its publishes then go there).
    """
    import celery._state
    import kombu.pools

    if app._pool is not None:
        app._pool.force_close_all()
    app._pool = None
    app.amqp._producer_pool = None
    # Celery takes an app's connection and producer pools from kombu's registry (one pool per
    # broker URL, shared by every app of the process on that URL), whose pools may hold the
    # connections just closed: start the registry afresh too. That closes the pools every
    # other app in this process took from it (another module's shared app, such as the
    # session-scoped compat app), so each of them takes new ones on its next publish or
    # control command.
    kombu.pools.reset()
    for other in celery._state._get_active_apps():
        other._pool = None
        other.amqp._producer_pool = None
    app.conf.broker_url = url


@pytest.fixture(scope="module")
def wa(mode: Mode) -> Any:
    """The test process's copy of ``tests.support.worker_app``, pointed at this mode's servers."""
    os.environ.update(mode.env)
    from tests.support import worker_app

    point_at_broker(worker_app.app, mode.env["DLOCK_TEST_BROKER"])
    worker_app.app.conf.result_backend = mode.env["DLOCK_TEST_BACKEND"]
    use_lock_urls(worker_app.app, mode.lock_urls)
    return worker_app


@pytest.fixture
def journal(mode: Mode) -> Journal:
    journal = Journal(mode.env["DLOCK_TEST_JOURNAL"])
    journal.clear()
    mode.clear_locks()
    return journal


@pytest.fixture(scope="module")
def worker(mode: Mode, wa: Any) -> Iterator[Worker]:
    journal = Journal(mode.env["DLOCK_TEST_JOURNAL"])
    started = Worker(mode.env, journal, name=f"main-{mode.name}").start()
    yield started
    started.stop()
    # AsyncResults of this module's tests are collected now, while the result backend they
    # would unsubscribe from is still up (not at some later module's collection).
    gc.collect()


def submit_concurrently(fn: Any, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` for every call at once from threads; results in order."""
    results: list[Any] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def go(i: int) -> None:
        barrier.wait()
        args, kwargs = calls[i]
        results[i] = fn(*args, **kwargs)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


@contextmanager
def node_timeout(app: Any, seconds: float) -> Iterator[None]:
    """``dlock_node_timeout`` of ``app`` in this process set to ``seconds`` meanwhile."""
    before = app.conf.dlock_node_timeout
    app.conf.dlock_node_timeout = seconds
    registry.forget(app)
    try:
        yield
    finally:
        app.conf.dlock_node_timeout = before
        registry.forget(app)
