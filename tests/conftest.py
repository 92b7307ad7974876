"""Fixtures: real redis-servers on 127.0.0.1: one for single-instance tests, five for Redlock.

Set ``DLOCK_TEST_REDIS_URLS`` (comma-separated) to run against servers you already have: the
first URL serves the single-instance tests, the first five the Redlock tests; tests that stop,
pause or restart servers (marked ``local_redis``) are skipped then, and the suite flushes
those databases between tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from celery_dlock.renewal import watchdog
from celery_dlock.testing import RedisServer, redis_servers
from tests.clients import client, close_all

pytest_plugins = ("tests.celery_fixtures", "tests.compat_fixtures")

EXTERNAL = [u for u in os.environ.get("DLOCK_TEST_REDIS_URLS", "").split(",") if u.strip()]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not EXTERNAL:
        return
    skip = pytest.mark.skip(reason="DLOCK_TEST_REDIS_URLS is set: cannot stop or restart those")
    for item in items:
        if "local_redis" in item.keywords:
            item.add_marker(skip)


def _flush(urls: list[str]) -> None:
    for url in urls:
        client(url).flushdb()


@pytest.fixture(scope="session")
def single_session_urls() -> Iterator[list[str]]:
    if EXTERNAL:
        yield EXTERNAL[:1]
        return
    with RedisServer() as server:
        yield [server.url]


@pytest.fixture(scope="session")
def redlock_session_urls() -> Iterator[list[str]]:
    if EXTERNAL:
        if len(EXTERNAL) < 5:
            pytest.skip("DLOCK_TEST_REDIS_URLS has fewer than five URLs: no Redlock tests")
        yield EXTERNAL[:5]
        return
    with redis_servers(5) as servers:
        yield [s.url for s in servers]


@pytest.fixture
def single_urls(single_session_urls: list[str]) -> list[str]:
    """One Redis URL, emptied before the test."""
    _flush(single_session_urls)
    return single_session_urls


@pytest.fixture
def redlock_urls(redlock_session_urls: list[str]) -> list[str]:
    """Five independent Redis masters, emptied before the test."""
    _flush(redlock_session_urls)
    return redlock_session_urls


@pytest.fixture(params=["single", "redlock5"])
def urls(request: pytest.FixtureRequest) -> list[str]:
    """Run the test once on a single Redis and once on Redlock over five masters."""
    name = "single_urls" if request.param == "single" else "redlock_urls"
    result: list[str] = request.getfixturevalue(name)
    return result


@pytest.fixture
def servers() -> Iterator[list[RedisServer]]:
    """Five fresh servers of this test's own, free to stop, pause, restart and wipe."""
    with redis_servers(5) as started:
        yield started


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """One fresh server of this test's own, free to stop, pause, restart and wipe."""
    with RedisServer() as started:
        yield started


@pytest.fixture(scope="session", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    close_all()


@pytest.fixture(autouse=True)
def _no_leaked_leases() -> Iterator[None]:
    """Every test must release what it takes; a leak would renew keys into later tests."""
    yield
    leaked = list(watchdog._leases)
    for lease in leaked:
        lease.release()
    assert not leaked, f"test left leases held: {leaked}"
