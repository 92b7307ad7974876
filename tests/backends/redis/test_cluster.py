"""Redis Cluster as the lock store: a real three-master cluster started by the fixture.

Every key of one lock carries the hash tag ``{key}``, so one lock lives on one master while
different locks spread over all three; calls are routed by slot, the watchdog renews per slot,
MOVED after a slot migration is followed, and the operator command scans every master.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_dlock import ConfigError, LockContended, LockUnavailable, lock
from celery_dlock.backends.redis import scripts
from celery_dlock.backends.redis.diagnose import acl_rules
from celery_dlock.backends.redis.ending import void_key
from celery_dlock.backends.redis.inspection import revoked_key
from celery_dlock.backends.redis.redlock import LockManager
from celery_dlock.core.holder import value_head
from celery_dlock.core.registry import manager_for
from celery_dlock.testing import free_port
from tests.ops.test_cli import dlock
from tests.support.celery_fixtures import Mode, with_db
from tests.support.cluster import Cluster, redis_cluster
from tests.support.workers import Beat, Journal, Worker

pytestmark = pytest.mark.local_redis


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with redis_cluster(3) as started:
        yield started


@pytest.fixture
def url(cluster: Cluster) -> str:
    """The cluster's lock URL, every master emptied before the test."""
    cluster.flush()
    return cluster.url


def spread_keys(cluster: Cluster, count: int = 12) -> list[str]:
    """Lock keys whose slots belong to at least two (in practice all three) masters."""
    keys = [f"job-{i}" for i in range(count)]
    owners = {cluster.owner(f"dlock:{{{key}}}") for key in keys}
    assert len(owners) >= 2, f"keys {keys} all hash to one master {owners}"
    return keys


def master_client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=5)


def test_every_key_of_one_lock_is_in_one_slot(cluster: Cluster, url: str) -> None:
    manager = manager_for([url])
    lock_key, fence_key, signal_key = manager.redis_keys("meta:crm:42")
    conn = master_client(cluster.masters[0].port)
    try:
        slots = {
            int(conn.execute_command("CLUSTER", "KEYSLOT", k))
            for k in (
                lock_key,
                fence_key,
                signal_key,
                void_key(lock_key, value_head("task-1")),
                revoked_key(lock_key, "0123abcd"),
            )
        }
    finally:
        conn.close()
    assert len(slots) == 1


def test_scripts_touch_only_the_keys_they_are_given() -> None:
    """Cluster routes a script by the keys it declares; it must not reach for any other."""
    calls = re.compile(r"redis\.call\('(\w+)'(?:, ([^,)]+))?")
    for name, source in scripts.ALL.items():
        aliases = set(re.findall(r"local (\w+) = KEYS\[", source))
        # A local function's parameter is a key when every call passes one (scripts.BOUNDED).
        for function, parameter in re.findall(r"local function (\w+)\((\w+)\)", source):
            passed = re.findall(rf"\b{function}\(([^)]*)\)", source)[1:]  # [0]: definition
            assert passed, (name, function)
            assert all(arg.startswith("KEYS[") for arg in passed), (name, function, passed)
            aliases.add(parameter)
        found = calls.findall(source)
        assert found, name
        for command, first in found:
            if command != "TIME":
                assert first.startswith("KEYS[") or first in aliases, (name, command, first)


def test_locks_on_keys_over_every_master_exclude_and_fence(cluster: Cluster, url: str) -> None:
    keys = spread_keys(cluster)
    first: dict[str, int] = {}
    for key in keys:
        with lock([url], key, ttl=5) as lease:
            first[key] = lease.token
            # The key lives on the master that owns its slot, nowhere else.
            owner = cluster.owner(f"dlock:{{{key}}}")
            conn = master_client(owner)
            try:
                assert conn.get(f"dlock:{{{key}}}") is not None
            finally:
                conn.close()
            with pytest.raises(LockContended) as info, lock([url], key):
                pass
            assert info.value.holder is not None
            assert info.value.holder.fence == lease.token
    # Released: each key is free again, and its next token is larger.
    for key in keys:
        with lock([url], key, ttl=5) as again:
            assert again.token > first[key]


def test_renewal_keeps_short_leases_on_several_slots_alive(cluster: Cluster, url: str) -> None:
    keys = spread_keys(cluster, 8)
    manager = manager_for([url])
    leases = [manager.acquire(key, ttl=0.6) for key in keys]
    try:
        # Renewed together by the watchdog, one script call per slot: several ttls pass.
        until = time.monotonic() + 3 * 0.6
        while time.monotonic() < until:
            assert [lease.lost_reason for lease in leases] == [None] * len(leases)
            time.sleep(0.05)  # observing the leases over time; no synchronisation involved
        for key, lease in zip(keys, leases, strict=True):
            holder = manager.holder(key)
            assert holder is not None
            assert holder.fence == lease.token
    finally:
        for lease in leases:
            lease.release()
    assert [manager.holder(key) for key in keys] == [None] * len(keys)


def test_one_renewal_call_extends_leases_on_different_slots(cluster: Cluster, url: str) -> None:
    keys = spread_keys(cluster, 8)
    manager = manager_for([url])
    leases = [manager.acquire(key, ttl=5, renew=False) for key in keys]
    try:
        owners = {key: master_client(cluster.owner(f"dlock:{{{key}}}")) for key in keys}
        for key, conn in owners.items():  # shorten each key so that the extension shows
            assert conn.pexpire(f"dlock:{{{key}}}", 1000)
        assert manager.renew(leases) == [None] * len(leases)
        for key, conn in owners.items():
            assert conn.pttl(f"dlock:{{{key}}}") > 4000
            conn.close()
    finally:
        for lease in leases:
            lease.release()


def blocked_in_blpop(port: int) -> bool:
    conn = master_client(port)
    try:
        return any(c.get("cmd") == "blpop" for c in conn.client_list())
    finally:
        conn.close()


def test_a_release_wakes_a_waiter(cluster: Cluster, url: str) -> None:
    manager = manager_for([url])
    held = manager.acquire("report", ttl=30)
    got: list[Any] = []

    def wait() -> None:
        with lock([url], "report", ttl=5, wait=20) as lease:
            got.append((time.monotonic(), lease.token))

    waiter = threading.Thread(target=wait)
    waiter.start()
    # The waiter blocks on the signal list, on the master that owns the lock's slot.
    owner = cluster.owner(manager.redis_keys("report")[2])
    deadline = time.monotonic() + 5
    while not blocked_in_blpop(owner):
        assert time.monotonic() < deadline, "the waiter never blocked on the signal list"
        time.sleep(0.01)
    released_at = time.monotonic()
    assert held.release()
    waiter.join(10)
    assert got, "the waiter never got the lock"
    woke_at, token = got[0]
    assert woke_at - released_at < 2.0, "woken by the ttl, not by the release"
    assert token > held.token


def test_a_key_starting_with_a_brace_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="starts with '}'"), lock([url], "}x"):
        pass


def test_a_slot_moved_to_another_master_is_followed(cluster: Cluster, url: str) -> None:
    manager = manager_for([url])
    key = "migrating"
    with lock([url], key, ttl=5):
        pass  # the manager now knows the slot map
    source_port = cluster.owner(f"dlock:{{{key}}}")
    source = next(m for m in cluster.masters if m.port == source_port)
    target = next(m for m in cluster.masters if m.port != source_port)
    clients = {m.port: master_client(m.port) for m in cluster.masters}
    try:
        slot = int(clients[source.port].execute_command("CLUSTER", "KEYSLOT", f"dlock:{{{key}}}"))
        ids = {m.port: clients[m.port].execute_command("CLUSTER", "MYID") for m in cluster.masters}
        for conn in clients.values():  # the slot's keys (fence counter) went with FLUSHALL
            conn.flushall()
        clients[target.port].execute_command(
            "CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source.port]
        )
        clients[source.port].execute_command(
            "CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target.port]
        )
        # Half migrated: the source says ASK, the target refuses a script whose keys are not
        # all there yet (TRYAGAIN): the lock is unavailable, not silently split.
        with pytest.raises(LockUnavailable, match=r"TRYAGAIN|TryAgain"), lock([url], key):
            pass
        for port in (target.port, source.port, *clients):
            clients[port].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target.port])
        # The manager's map still names the source: it answers MOVED, which is followed.
        with lock([url], key, ttl=5) as lease:
            assert clients[target.port].get(f"dlock:{{{key}}}") is not None
            with pytest.raises(redis.exceptions.MovedError):
                clients[source.port].get(f"dlock:{{{key}}}")
            assert manager.holder(key) is not None
            assert lease.token > 0
    finally:
        for conn in clients.values():
            conn.close()


def test_the_operator_command_lists_and_releases_on_every_master(
    cluster: Cluster, url: str
) -> None:
    keys = spread_keys(cluster, 6)
    manager: LockManager = manager_for([url])
    leases = [manager.acquire(key, ttl=5, holder=f"task-{key}", renew=False) for key in keys]
    lost = threading.Event()
    watched = manager.acquire("replication", ttl=1.5, holder="task-r")
    watched.on_lost(lambda _lease, _error: lost.set())
    try:
        listed = dlock([cluster.seed_url], "list", "--json")
        assert listed.returncode == 0, listed.stderr
        rows = {r["key"]: r for r in map(json.loads, listed.stdout.splitlines())}
        assert set(rows) == {*keys, "replication"}
        for key, lease in zip(keys, leases, strict=True):
            assert rows[key]["fence"] == lease.token
            assert rows[key]["task_id"] == f"task-{key}"

        done = dlock([cluster.seed_url], "release", "replication", "--yes", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"key": "replication", "released": True, "held": True}
        assert lost.wait(0.5 + 0.5), "the holder did not notice the forced release"
        assert manager.holder("replication") is None
    finally:
        watched.release()
        for lease in leases:
            lease.release()


# -- a SingletonTask in a real prefork worker -------------------------------------------------


@pytest.fixture(scope="module")
def mode(cluster: Cluster, celery_base: str) -> Mode:
    """Broker, results and journal on the suite's plain Redis; the locks on the cluster."""
    env = {
        "DLOCK_TEST_BROKER": with_db(celery_base, 10),
        "DLOCK_TEST_BACKEND": with_db(celery_base, 11),
        "DLOCK_TEST_JOURNAL": with_db(celery_base, 13),
        "DLOCK_TEST_LOCK_URLS": cluster.seed_url,
    }
    return Mode("cluster", [cluster.seed_url], env)


@pytest.fixture
def journal(mode: Mode, cluster: Cluster) -> Journal:
    journal = Journal(mode.env["DLOCK_TEST_JOURNAL"])
    journal.clear()
    cluster.flush()
    return journal


def test_singleton_tasks_in_a_worker_on_the_cluster(
    wa: Any, worker: Worker, journal: Journal, cluster: Cluster
) -> None:
    results = [wa.drop_task.delay("storm", 1.5) for _ in range(8)]
    values = [r.get(timeout=20) for r in results]
    starts = journal.select("start", name="storm")
    assert len(starts) == 1, starts
    assert values.count("storm") == 1
    assert all(v["dlock_dropped"] is True for v in values if v != "storm")
    # Distinct keys, on different masters, all run.
    entities = [f"e{i}" for i in range(6)]
    done = [wa.collect.delay("src", e, secs=0.2) for e in entities]
    assert sorted(r.get(timeout=20) for r in done) == sorted(f"src:{e}" for e in entities)
    started = journal.select("start")
    assert len(started) == 1 + len(entities)
    owners = {cluster.owner(f"dlock:{{{e['key']}}}") for e in started}
    assert len(owners) >= 2, f"every task key hashed to one master: {started}"
    assert all(e["token"] for e in started)


# -- misconfiguration --------------------------------------------------------------------------


def test_an_unreachable_cluster_is_unavailable_with_the_password_hidden() -> None:
    url = f"redis+cluster://:s3cret@127.0.0.1:{free_port()}"
    with pytest.raises(LockUnavailable) as info, lock([url], "k"):
        pass
    text = str(info.value)
    assert "cannot reach the cluster" in text
    assert "s3cret" not in text
    assert "redis+cluster://:***@127.0.0.1:" in text


def test_a_cluster_with_a_password_locks_and_never_shows_it() -> None:
    with redis_cluster(3, password="s3cret-pw") as secured:
        keys = spread_keys(secured, 6)
        for key in keys:
            with lock([secured.url], key, ttl=5) as lease:
                assert lease.token > 0
        wrong = secured.url.replace("s3cret-pw", "wrong-pw")
        with pytest.raises(LockUnavailable) as info, lock([wrong], "k"):
            pass
        text = str(info.value)
        assert "wrong password" in text
        assert "wrong-pw" not in text
        listed = dlock([secured.seed_url], "list")
        assert listed.returncode == 0, listed.stderr
        assert "s3cret-pw" not in listed.stdout + listed.stderr


def test_a_plain_url_for_a_cluster_node_says_to_use_redis_cluster(cluster: Cluster) -> None:
    node = cluster.masters[0]
    key = next(k for k in spread_keys(cluster) if cluster.owner(f"dlock:{{{k}}}") != node.port)
    plain = f"redis://127.0.0.1:{node.port}/0"
    with pytest.raises(LockUnavailable, match=r"must be redis\+cluster://"), lock([plain], key):
        pass


# -- an ACL user with the documented rules ----------------------------------------------------

ACL_PASSWORD = "cluster-acl-pw"


def set_cluster_user(cluster: Cluster, user: str, rules: str) -> str:
    """(Re)create ``user`` on every master, as docs/topologies.md's Cluster line does; its
    one-seed lock URL."""
    for server in cluster.masters:
        admin = master_client(server.port)
        try:
            admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{ACL_PASSWORD}",
                                  "-@all", *rules.split())  # fmt: skip
        finally:
            admin.close()
    return f"redis+cluster://{user}:{ACL_PASSWORD}@127.0.0.1:{cluster.masters[0].port}"


def test_the_documented_acl_line_works_on_a_cluster(
    cluster: Cluster, wa: Any, worker: Worker, journal: Journal, mode: Mode
) -> None:
    """Issue 19, item 5: lock, CLI and beat as an ACL user with exactly the Cluster line of
    docs/topologies.md; a user without a Cluster grant is told which and how to grant it."""
    from tests.backends.redis.test_tls_acl import exercise

    docs = (Path(__file__).resolve().parents[3] / "docs" / "topologies.md").read_text()
    assert f"ACL SETUSER dlock on >PASSWORD -@all {acl_rules(cluster=True)}\n" in docs
    admin_rules = acl_rules(cluster=True, operator=True)
    assert f"ACL SETUSER dlock-admin on >PASSWORD -@all {admin_rules}\n" in docs
    seed = set_cluster_user(cluster, "dlock", admin_rules)  # exercise() lists the keys too
    exercise([seed], "acl-cluster", ttl=1.0)  # acquire, renew, wait and wake, list, release

    with lock([seed], "acl-cli", ttl=10):
        listed = dlock([seed], "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line)["key"] for line in listed.stdout.splitlines()] == ["acl-cli"]

    env = {**mode.env, "DLOCK_TEST_LOCK_URLS": seed, "DLOCK_TEST_BEAT": "aclbeat:0"}
    beat = Beat(env, name="acl-cluster", scheduler="dlock").start()
    try:
        starts = journal.wait_for("start", count=2, timeout=15, name="aclbeat")
    finally:
        beat.stop()
    assert all(s["tick"] for s in starts), starts  # each send claimed its tick key
    assert " is the leader " in beat.log()
    assert ACL_PASSWORD not in beat.log()

    plain = acl_rules()
    for user, rules, refused in [
        ("plain", plain, "'cluster'"),  # the line for one Redis: no CLUSTER SLOTS
        ("nocommand", f"{plain} +cluster|slots", "'command'"),
    ]:
        url = set_cluster_user(cluster, user, rules)
        with pytest.raises(LockUnavailable) as info, lock([url], "k"):
            pass
        text = str(info.value)
        assert f"NoPermissionError: ACL user {user!r} may not run" in text, text
        assert f"no permissions to run the {refused} command" in text, text
        assert text.endswith(f"grant them with: ACL SETUSER {user} {acl_rules(cluster=True)})")
        assert "Cluster mode is not enabled" not in text
    refused_cli = dlock([url], "list")  # the operator command says it too
    assert refused_cli.returncode == 1
    assert "ACL user 'nocommand' may not run" in refused_cli.stderr, refused_cli.stderr
    assert "Traceback" not in refused_cli.stderr
