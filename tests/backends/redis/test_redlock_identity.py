"""Redlock URLs that reach one Redis server under two names (``127.0.0.1`` and ``localhost``,
same port) are refused at first contact, naming both URLs: the servers' ``INFO server``
``run_id`` tells them apart, not their names. Real redis-server processes."""

from __future__ import annotations

import time

import pytest

from celery_dlock import ConfigError, LockLost, lock
from celery_dlock.testing import RedisServer
from tests.ops.test_cli import dlock
from tests.support.clients import client

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


def test_a_duplicate_found_mid_lease_loses_the_lease_saying_why_without_a_log_flood(
    servers: list[RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """The third URL names the first server by another address (127.0.0.2) that is down at
    first contact: the lease is taken on two servers. Once that address answers, the renewal
    meets the duplicate: the lease is lost naming both URLs, at once, not after its validity
    ran out, and the watchdog does not spin logging a traceback per round meanwhile."""
    a, b = servers[0], servers[1]
    urls = [a.url, b.url, f"redis://127.0.0.2:{a.port}/0"]
    ttl = 6.0  # renewals every 2 s: the first one past the twin's cool-down meets it
    with pytest.raises(LockLost) as info, lock(urls, "late-twin", ttl=ttl) as lease:
        client(a.url).config_set("bind", "127.0.0.1 127.0.0.2")  # the twin is up now
        deadline = time.monotonic() + ttl  # well within the validity (renewals are at ttl/3)
        while not lease.lost:
            assert time.monotonic() < deadline, "the lease was never lost"
            time.sleep(0.01)
        assert "reach the same Redis server" in str(lease.lost_reason), lease.lost_reason
    assert f"{urls[0]!r} and {urls[2]!r} reach the same Redis server" in str(info.value)
    rounds = [r for r in caplog.records if r.getMessage() == "watchdog round failed"]
    assert len(rounds) <= 1, f"{len(rounds)} failed watchdog rounds logged"


def test_two_names_for_one_server_are_refused_for_a_user_with_the_documented_acl(
    servers: list[RedisServer],
) -> None:
    """A lock user made as docs/topologies.md says (``acl_rules()``, least privilege) must
    still let the servers say who they are: a server that denies INFO is not checked."""
    from celery_dlock.backends.redis.diagnose import acl_rules

    for server in servers[:2]:
        client(server.url).execute_command(
            "ACL", "SETUSER", "dlock", "on", ">pw", "-@all", *acl_rules().split()
        )
    # db 0: the documented rules grant no SELECT
    urls = [u.replace("redis://", "redis://dlock:pw@")[:-1] + "0" for u in twice(servers)]
    with pytest.raises(ConfigError) as info, lock(urls, "acl-one-server", ttl=5):
        pytest.fail("acquired with one server counted twice")
    assert "reach the same Redis server" in str(info.value), str(info.value)


def test_a_release_that_meets_a_late_twin_does_not_raise(servers: list[RedisServer]) -> None:
    """The twin address is down when the lease is taken and answers by the release, once its
    cool-down has passed: the release finds two URLs reaching one server and does not send,
    but returns False (a release never raises; the copies expire within the ttl)."""
    from celery_dlock.core.registry import manager_for

    a, b = servers[0], servers[1]
    urls = [a.url, b.url, f"redis://127.0.0.2:{a.port}/0"]
    manager = manager_for(urls)
    lease = manager.acquire("release-twin", ttl=30, renew=False)
    client(a.url).config_set("bind", "127.0.0.1 127.0.0.2")  # the twin is up now
    twin = manager.nodes[2]
    deadline = time.monotonic() + 30
    while twin.down:  # the acquire's failure put it in a cool-down: the release tries it after
        assert time.monotonic() < deadline, "the twin never left its cool-down"
        time.sleep(0.05)
    assert lease.release() is False
