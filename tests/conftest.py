"""Fixtures: real redis-servers on 127.0.0.1: one for single-instance tests, five for Redlock.

Set ``DLOCK_TEST_REDIS_URLS`` (comma-separated) to run against servers you already have: the
first URL serves the single-instance tests, the first five the Redlock tests; tests that stop,
pause or restart servers (marked ``local_redis``) are skipped then, and the suite flushes
those databases between tests.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from celery_dlock.core.renewal import watchdog
from celery_dlock.testing import RedisServer, redis_servers
from tests.support.clients import client, close_all

pytest_plugins = ("tests.support.celery_fixtures", "tests.support.compat_fixtures")

EXTERNAL = [u for u in os.environ.get("DLOCK_TEST_REDIS_URLS", "").split(",") if u.strip()]


#: The lock stores the ``urls`` and ``mode`` fixtures run a test on, unless its module lists
#: its own in a module-level ``MODES`` (adding "zookeeper" opts a module in: its tests then run
#: on a ZooKeeper server too, which costs time, so only where the behaviour is the backend's).
EXTERNAL_REASON = "DLOCK_TEST_REDIS_URLS is set: cannot stop or restart those"
DEFAULT_MODES = ("single", "redlock5")
ALL_MODES = ("single", "redlock5", "zookeeper")


def _param_mode(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    for name in ("mode", "urls"):
        if name in callspec.params and callspec.params[name] in ALL_MODES:
            return str(callspec.params[name])
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drop the modes a module did not ask for (see ``MODES``) and the parameter combinations
    its ``KEEP(params)``, if it has one, refuses; skip, on ZooKeeper, the tests
    marked ``redis_only(reason)`` and those needing queued locks (``queued_locks``) until
    the ZooKeeper backend has them (``tests.support.zookeeper.QUEUED_LOCKS``)."""
    from tests.support.zookeeper import QUEUED_LOCKS, QUEUED_REASON

    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        mode = _param_mode(item)
        wanted = getattr(getattr(item, "module", None), "MODES", DEFAULT_MODES)
        keep = getattr(getattr(item, "module", None), "KEEP", None)
        callspec = getattr(item, "callspec", None)
        if (mode is not None and mode not in wanted) or (
            keep is not None and callspec is not None and not keep(callspec.params)
        ):
            dropped.append(item)
            continue
        kept.append(item)
        if mode == "zookeeper":
            marker = item.get_closest_marker("redis_only")
            if marker is not None:
                item.add_marker(pytest.mark.skip(reason=f"on ZooKeeper: {marker.args[0]}"))
            elif item.get_closest_marker("queued_locks") is not None and not QUEUED_LOCKS:
                item.add_marker(pytest.mark.skip(reason=QUEUED_REASON))
        if EXTERNAL and "local_redis" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=EXTERNAL_REASON))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


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


@pytest.fixture(scope="session")
def zookeeper_session_url() -> Iterator[str]:
    """A standalone ZooKeeper server of this test process (skips, saying why, without one)."""
    from tests.support.zookeeper import CHROOT, skip_reason, standalone

    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with standalone() as server:
        yield f"zookeeper://{server.hosts}{CHROOT}"
        from celery_dlock.backends.zookeeper import close_all

        close_all()  # before the server goes, or kazoo would keep reconnecting until exit


@pytest.fixture(scope="session")
def rabbitmq_url() -> Iterator[str]:
    """The Celery broker URL of a RabbitMQ server of this test process (``amqp://``), started
    on first use and stopped at the end of the session; skips, saying why, without one."""
    from tests.support.rabbitmq import rabbitmq, skip_reason

    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with rabbitmq() as server:
        yield server.url


@pytest.fixture
def zookeeper_urls(zookeeper_session_url: str) -> list[str]:
    """The ZooKeeper lock store, emptied before the test."""
    from celery_dlock.backends.zookeeper import parse
    from tests.support.zookeeper import wipe

    url = parse(zookeeper_session_url)
    wipe(url.connect_string, url.chroot)
    return [zookeeper_session_url]


@pytest.fixture(params=ALL_MODES)
def urls(request: pytest.FixtureRequest) -> list[str]:
    """Run the test once on a single Redis and once on Redlock over five masters (and once on
    ZooKeeper where the module's ``MODES`` lists it)."""
    names = {"single": "single_urls", "redlock5": "redlock_urls", "zookeeper": "zookeeper_urls"}
    result: list[str] = request.getfixturevalue(names[request.param])
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


@pytest.fixture(scope="module", autouse=True)
def _close_zookeeper_clients() -> Iterator[None]:
    """Close this process's ZooKeeper clients after each module: a connected kazoo client
    draws from the global ``random`` on every loop of its connection thread, which makes
    hypothesis (tests/celery/test_wire_keys.py) report flaky data generation in a later module."""
    yield
    zookeeper = sys.modules.get("celery_dlock.backends.zookeeper")
    if zookeeper is not None:
        zookeeper.close_all()


@pytest.fixture(autouse=True)
def _no_leaked_leases() -> Iterator[None]:
    """Every test must release what it takes; a leak would renew keys into later tests."""
    yield
    leaked = list(watchdog._leases)
    for lease in leaked:
        lease.release()
    assert not leaked, f"test left leases held: {leaked}"
