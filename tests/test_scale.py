"""What a lock leaves on the server and costs it as work grows (issue 34), on real servers.

Each test reads the server's own account (key ttls, the slow log, ``CLIENT LIST``,
``INFO commandstats``), never a timing of this host: the figures are counts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from celery_dlock.config import Settings
from celery_dlock.redis.redlock import LockManager
from tests.clients import client

DAY_MS = 86_400_000


@pytest.fixture
def manager(single_urls: list[str]) -> Iterator[LockManager]:
    made = LockManager(Settings(urls=single_urls))
    yield made
    made.close()


def test_a_released_key_leaves_nothing_a_day_later(
    single_urls: list[str], manager: LockManager
) -> None:
    # Default settings: whatever a lock-and-release leaves must expire within a day.
    for i in range(20):
        manager.acquire(f"once-{i}", ttl=5, renew=False).release()
    plain = client(single_urls[0])
    left = {name: plain.pttl(name) for name in plain.scan_iter()}
    assert left, "expected the fence counters to be there right after"
    lasting = {name: ttl for name, ttl in left.items() if ttl == -1 or ttl > DAY_MS}
    assert not lasting, f"keys that outlive a day after release: {lasting}"


def _commands(plain: redis.Redis) -> dict[str, int]:
    stats = plain.info("commandstats")
    return {name[8:]: int(stat["calls"]) for name, stat in stats.items()}


def test_renewing_many_leases_never_holds_the_server_for_more_than_200_of_them(
    single_urls: list[str], manager: LockManager
) -> None:
    # A call holds Redis for its whole run: 10,000 leases in one call held it ~80 ms. The
    # slow log, at a threshold of 0, lists every call with its key count.
    plain = client(single_urls[0])
    leases = [manager.acquire(f"many-{i}", ttl=60, renew=False) for i in range(450)]
    manager.renew(leases[:1])  # the script cached: every call below is an EVALSHA
    before = plain.config_get("slowlog-*")
    plain.config_set("slowlog-max-len", 10_000)
    plain.config_set("slowlog-log-slower-than", 0)
    plain.slowlog_reset()
    try:
        outcomes = manager.renew(leases)
        entries = plain.slowlog_get(10_000)
    finally:
        for name, value in before.items():
            plain.config_set(name, value)
        for lease in leases:
            lease.release()
    assert outcomes == [None] * len(leases)
    calls = [bytes(e["command"]).split(b" ") for e in entries]
    renewing = [int(c[2]) // 3 for c in calls if c[0].upper() == b"EVALSHA"]
    assert sum(renewing) == len(leases), renewing
    assert max(renewing) <= 200, f"leases renewed per call: {renewing}"


def test_a_waiting_thread_uses_one_server_connection(
    single_urls: list[str], manager: LockManager
) -> None:
    plain = client(single_urls[0])
    holder = manager.acquire("busy", ttl=30, renew=False)
    before = {c["addr"] for c in plain.client_list()}
    done: list[bool] = []

    def waiter() -> None:
        manager.acquire("busy", ttl=5, wait=30, renew=False).release()
        done.append(True)

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not any(c["cmd"] == "blpop" for c in plain.client_list()):
            assert time.monotonic() < deadline, "the waiter never blocked"
        opened = [c for c in plain.client_list() if c["addr"] not in before]
    finally:
        holder.release()
        thread.join(10)
    assert done == [True]
    assert len(opened) == 1, f"connections the waiting thread opened: {opened}"
