"""The green pools with locks over TLS: a ``-P gevent`` and a ``-P eventlet`` worker (``-c 50``,
``-A tests.support.pool_app``) run locked tasks on a ``rediss://`` lock server (a TLS proxy that
requires a client certificate, in front of a Redis server of this module's own).

What it shows: the TLS sockets of green threads are polled right (eventlet's ``select.select``
in place of ``select.poll``, pending TLS bytes), and an ended task's connection, handshake done,
serves the next task: TLS handshakes grow with the pool's concurrency, not the tasks run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import group

from celery_dlock.testing import RedisServer
from tests.support.celery_fixtures import Mode, make_mode
from tests.support.clients import client
from tests.support.tls import TlsProxy, make_certificates, tls_url
from tests.support.workers import Journal, Worker

pytestmark = [pytest.mark.slow, pytest.mark.local_redis]
CONCURRENCY = 50
TASKS = 300


@pytest.fixture(scope="module")
def lock_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def tls_lock_url(lock_server: RedisServer) -> Iterator[str]:
    certs = make_certificates()
    with TlsProxy(lock_server.port, certs) as proxy:
        yield tls_url(proxy.port, certs)


@pytest.fixture(scope="module")
def mode(celery_base: str, tls_lock_url: str) -> Mode:
    return make_mode("single", celery_base, lock_urls=[tls_lock_url])


@pytest.fixture(scope="module")
def pa(wa: Any) -> Any:
    from tests.support import pool_app

    return pool_app


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_locked_tasks_over_tls(pool: str, pa: Any, mode: Mode, lock_server: RedisServer) -> None:
    journal = Journal(mode.env["DLOCK_TEST_JOURNAL"])
    worker = Worker(
        mode.env,
        journal,
        name=f"tls-{pool}",
        pool=pool,
        concurrency=CONCURRENCY,
        queue=f"tls_{pool}",
        app="tests.support.pool_app",
    ).start(timeout=60)
    redis = client(lock_server.url)
    try:
        before = int(redis.info("stats")["total_connections_received"])
        batch = group(pa.quick.s(n, 0.3) for n in range(TASKS)).apply_async(queue=worker.queue)
        assert batch.get(timeout=180) == list(range(TASKS))
        opened = int(redis.info("stats")["total_connections_received"]) - before
        # The tasks' greenlets' connections, the watchdog's, the cleanup thread's, one spare.
        print(f"\n{pool} -c {CONCURRENCY} over TLS: {opened} connections for {TASKS} tasks")
        assert opened <= CONCURRENCY + 4, opened
    finally:
        worker.stop()
