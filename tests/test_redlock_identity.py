"""Redlock URLs that reach one Redis server under two names (``127.0.0.1`` and ``localhost``,
same port) are refused at first contact, naming both URLs: the servers' ``INFO server``
``run_id`` tells them apart, not their names. Real redis-server processes."""

from __future__ import annotations

import pytest

from celery_dlock import ConfigError, lock
from celery_dlock.testing import RedisServer
from tests.clients import client
from tests.test_cli import dlock

pytestmark = pytest.mark.local_redis


def twice(servers: list[RedisServer]) -> list[str]:
    """Three URLs, the first two one server (by address and by name), the third another."""
    a, b = servers[0].port, servers[1].port
    return [f"redis://127.0.0.1:{a}/4", f"redis://localhost:{a}/4", f"redis://127.0.0.1:{b}/4"]


def test_two_names_for_one_server_are_refused_at_first_contact(
    servers: list[RedisServer],
) -> None:
    urls = twice(servers)
    for _ in range(2):  # and again on the next call: nothing was taken meanwhile
        with pytest.raises(ConfigError) as info, lock(urls, "one-server", ttl=5):
            pytest.fail("acquired with one server counted twice")
        message = str(info.value)
        assert urls[0] in message, message
        assert urls[1] in message, message
        assert "reach the same Redis server (its INFO server run_id is " in message, message
    assert client(urls[0]).keys("*one-server*") == []


def test_three_servers_with_names_pass(servers: list[RedisServer]) -> None:
    a, b, c = (s.port for s in servers[:3])
    urls = [f"redis://localhost:{a}/4", f"redis://127.0.0.1:{b}/4", f"redis://127.0.0.1:{c}/4"]
    with lock(urls, "three-servers", ttl=5) as lease:
        assert lease.token > 0


def test_dlock_check_says_two_urls_reach_one_server(servers: list[RedisServer]) -> None:
    urls = twice(servers)
    done = dlock(urls, "check")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "nodes answered" not in done.stdout, done.stdout
    assert f"{urls[0]!r} and {urls[1]!r} reach the same Redis server" in done.stderr, done.stderr
