"""Sentinel: locks through a master group, a forced failover, and the lock a failover loses.

Real processes on 127.0.0.1: a master, a replica, three sentinels (:mod:`tests.support.sentinel`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_dlock import LockContended, LockLost, LockUnavailable, SingletonTask, lock
from celery_dlock.core.lease import Lease
from celery_dlock.core.registry import manager_for
from celery_dlock.testing import free_port
from tests.project.test_docs import topology_examples
from tests.support.sentinel import Group, poll, sentinel_group

pytestmark = [pytest.mark.local_redis, pytest.mark.slow]

TTL = 6.0  # renewed every 2 s; long enough to outlast a failover's few seconds


@pytest.fixture
def group() -> Iterator[Group]:
    with sentinel_group() as started:
        yield started


def data(port: int, key: str) -> Any:
    client = redis.Redis(port=port, socket_timeout=5)
    try:
        return client.get(f"dlock:{{{key}}}")
    finally:
        client.close()


def test_lock_and_singleton_task_through_sentinel(group: Group) -> None:
    with lock([group.url], "s-basic", ttl=TTL) as lease:
        assert data(group.master.port, "s-basic") is not None
        with pytest.raises(LockContended):
            lock([group.url], "s-basic").acquire()
        assert lease.token > 0
    assert data(group.master.port, "s-basic") is None

    app = Celery("sentinel", set_as_current=False)
    app.conf.update(dlock_urls=[group.url], task_always_eager=True)

    @app.task(base=SingletonTask, bind=True, lock_key="job:{n}", shared=False)
    def job(self: Any, n: int) -> str:
        return str(data(group.master.port, f"job:{n}") is not None and self.lease.token > 0)

    assert job.delay(1).get() == "True"


def test_failover_keeps_a_replicated_lease_and_moves_to_the_new_master(group: Group) -> None:
    lease = lock([group.url], "s-kept", ttl=TTL).acquire()
    try:
        poll("the lock to reach the replica", lambda: data(group.replica.port, "s-kept"))
        renewals = lease.renewals
        group.fail_over()
        # The holder renews on the new master (it finds it through the sentinels).
        poll("a renewal on the new master", lambda: lease.renewals >= renewals + 2, TTL * 2)
        lease.ensure()
        assert data(group.replica.port, "s-kept") is not None  # the replica is master now
        with lock([group.url], "s-new", ttl=TTL):
            assert data(group.replica.port, "s-new") is not None
    finally:
        lease.release()
    assert data(group.replica.port, "s-kept") is None


def test_the_first_release_after_a_failover_reaches_the_new_master(group: Group) -> None:
    """Sentinel closes the old master's clients when it demotes it. The end-of-task release
    (no reply awaited) on a thread whose connection was closed so must still reach the new
    master, not vanish into the dead socket (issue "Seams, Redis side", item 1)."""
    lease = lock([group.url], "s-after", ttl=2 * TTL).acquire()
    poll("the lock to reach the replica", lambda: data(group.replica.port, "s-after"))
    group.fail_over()  # returns once the old master follows the new one
    assert data(group.replica.port, "s-after") is not None  # the new master has the key
    lease.release(wait=False)  # on this thread's connection, to the old master
    poll("the release on the new master", lambda: data(group.replica.port, "s-after") is None, 1)


def test_failover_before_replication_loses_the_lock_and_the_holder_learns_it(
    group: Group,
) -> None:
    """The documented case: Sentinel replicates asynchronously, so a failover can promote a
    replica that never saw the lock. A second client then gets it while the first still holds
    it; the first learns at its next renewal, and its fencing token is the older one."""
    group.link.freeze()  # the replica stops hearing from the master
    lost = threading.Event()
    seen: list[tuple[float, LockLost]] = []

    def on_lost(lease: Lease, error: LockLost) -> None:
        seen.append((time.monotonic(), error))
        lost.set()

    # A longer lease, so it is certainly still valid on its holder's clock at the takeover.
    first = lock([group.url], "s-lost", ttl=2 * TTL, on_lost=on_lost).acquire()
    try:
        assert data(group.replica.port, "s-lost") is None
        group.fail_over()
        group.link.close()  # what the master sent meanwhile is gone with the link
        switched = time.monotonic()

        # Two holders at once: the new master never had the key.
        second = lock([group.url], "s-lost", ttl=TTL).acquire()
        try:
            # The first holder's lease was still valid on its own clock: two holders at once.
            assert first.deadline > second.acquired_at
            assert second.token > first.token  # a fenced store refuses the first's writes
            interval = first.renew_interval or 0.0
            assert lost.wait(interval + 2.0), "the first holder never learned of the loss"
            assert seen[0][0] - switched < interval + 2.0
            assert "gone" in seen[0][1].reason or "another holder" in seen[0][1].reason
            with pytest.raises(LockLost):
                first.ensure()
            second.ensure()
        finally:
            second.release()
    finally:
        first.release()


def test_an_unknown_service_names_the_url_and_the_service(group: Group) -> None:
    url = group.url.replace("/mymaster/", "/nosuch/")
    with pytest.raises(LockUnavailable) as info:
        manager_for([url]).acquire("s-x", ttl=TTL)
    assert "no sentinel named a master for 'nosuch'" in str(info.value)
    assert "redis+sentinel://127.0.0.1:" in str(info.value)


def test_unreachable_sentinels_fail_fast_with_the_password_hidden() -> None:
    dead = f"redis+sentinel://:s3cret@127.0.0.1:{free_port()},127.0.0.1:{free_port()}/m/0"
    begun = time.monotonic()
    with pytest.raises(LockUnavailable) as info:
        manager_for([dead]).acquire("s-x", ttl=TTL)
    assert time.monotonic() - begun < 2.0  # refused connections: no retries, no backoff
    assert "the sentinels are unreachable" in str(info.value)
    assert "s3cret" not in str(info.value)
    assert "redis+sentinel://:***@127.0.0.1:" in str(info.value)


def test_the_docs_sentinel_example_runs_against_a_real_group(group: Group) -> None:
    (code,) = topology_examples("sentinel")
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in group.sentinels)
    code = code.replace("127.0.0.1:26379,127.0.0.1:26380,127.0.0.1:26381", hosts)
    assert hosts in code
    exec(compile(code, "topologies.md sentinel example", "exec"), {"__name__": "docs"})
