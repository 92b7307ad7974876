"""A planned Sentinel failover keeps one holder per key (issue 19, items 1, 2 and 6).

``SENTINEL FAILOVER`` promotes the replica at once, but leaves the old master a writable master
until Sentinel demotes it, about ten seconds later. A connection opened before the switch used
to keep renewing there while the new master's copy of the key expired, so another client could
take the key on the new master while the first still held it. Now each process hears the
sentinels' ``+switch-master`` and stops acting on the old master at once; a server demoted
by hand (``REPLICAOF``, which keeps its clients) answers scripts ``READONLY``, which also makes
the connection ask the sentinels again.

One failover per test shows it for leases of ttl 3, 6 and 9 s held in this process (probed all
along by a second lock manager), a real prefork worker running a long body (copies of it sent
all along), and two leader-elected beats: whether Sentinel demotes the old master or an
operator does it by hand.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_dlock import LockContended, LockLost, LockUnavailable, lock
from celery_dlock.backends.redis import nodes
from celery_dlock.backends.redis.redlock import LockManager
from celery_dlock.core.config import Settings
from celery_dlock.core.lease import Lease
from tests.support.celery_fixtures import with_db
from tests.support.clients import client
from tests.support.sentinel import Group, poll, sentinel_group
from tests.support.workers import Beat, Journal, Worker, intervals, overlaps

pytestmark = [pytest.mark.local_redis, pytest.mark.slow]

TTLS = (3.0, 6.0, 9.0)
#: How long past the switch the holders keep their leases: past the longest ttl, so a key
#: left to expire on the new master would have expired there and been taken by a prober.
HOLD = 10.0
#: The worker's body: it starts before the switch and ends after HOLD (with room to spare,
#: so no copy sent during HOLD can run).
BODY = 15.0


@pytest.fixture
def group() -> Iterator[Group]:
    with sentinel_group() as started:
        yield started


def on_master(port: int, key: str) -> Any:
    conn = redis.Redis(port=port, socket_timeout=5)
    try:
        return conn.get(f"dlock:{{{key}}}")
    finally:
        conn.close()


class Prober:
    """Tries to take ``key`` every 50 ms through a lock manager of its own (its own sentinel
    subscriptions and connections), recording each success and giving the key straight back."""

    def __init__(self, url: str, key: str) -> None:
        self.key = key
        self.manager = LockManager(Settings(urls=(url,)))
        self.got: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                lease = self.manager.acquire(self.key, ttl=1, renew=False)
            except (LockContended, LockUnavailable):
                pass
            else:
                self.got.append(time.monotonic())
                lease.release()
            self._stop.wait(0.05)  # the probing rate, not synchronisation

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.manager.close()


@pytest.mark.parametrize("demote", ["sentinel", "replicaof"])
def test_a_planned_failover_keeps_one_holder(group: Group, celery_base: str, demote: str) -> None:
    env = {
        "DLOCK_TEST_BROKER": with_db(celery_base, 5),
        "DLOCK_TEST_BACKEND": with_db(celery_base, 6),
        "DLOCK_TEST_JOURNAL": with_db(celery_base, 7),
        "DLOCK_TEST_LOCK_URL": group.url,
    }
    for db in (5, 6, 7):
        client(with_db(celery_base, db)).flushdb()
    journal = Journal(env["DLOCK_TEST_JOURNAL"])
    sender = Celery("failover-sender", broker=env["DLOCK_TEST_BROKER"], set_as_current=False)
    worker = Worker(env, journal, name=f"failover-{demote}", concurrency=2)
    beat_env = {**env, "DLOCK_TEST_BEAT": "led:0", "DLOCK_TEST_BEAT_TTL": "10"}
    beats = [Beat(beat_env, name=f"leader-{i}", scheduler="dlock") for i in (1, 2)]
    leases: dict[str, Lease] = {}
    lost: dict[str, float] = {}
    probers: list[Prober] = []

    def told(lease: Lease, error: LockLost) -> None:
        lost.setdefault(lease.key, time.monotonic())

    try:
        worker.start()
        for beat in beats:
            beat.start()
        sender.send_task("tests.worker_app.failover_task", ("fo", BODY))
        journal.wait_for("start", name="fo")
        journal.wait_for("start", name="led")  # a leader sends
        for ttl in TTLS:
            key = f"held-{ttl:g}"
            leases[key] = lock([group.url], key, ttl=ttl, on_lost=told).acquire()
        keys = [*leases, "failover:fo"]
        for key in keys:
            poll(f"{key} on the replica", lambda k=key: on_master(group.replica.port, k))
        probers = [Prober(group.url, key) for key in leases]

        switched = time.monotonic()
        group.switch()
        if demote == "replicaof":
            group.demote_by_hand()
        # Copies of the worker's task, sent all along: dropped while the body holds its key.
        while time.monotonic() < switched + HOLD:
            sender.send_task("tests.worker_app.failover_task", ("fo", 0.0))
            time.sleep(0.5)  # the sending rate, not synchronisation
        group.wait_demoted()

        # The leases in this process were renewed on the new master all along.
        for key, lease in leases.items():
            assert key not in lost, f"{key} was lost: {lease.lost_reason}"
            lease.ensure()
            assert on_master(group.replica.port, key) is not None
        # The end-of-task release (no reply awaited) frees each key on the new master.
        released: dict[str, float] = {}
        for key, lease in leases.items():
            released[key] = time.monotonic()
            lease.release(wait=False)
        for prober in probers:
            poll(f"{prober.key} to be taken after its release", lambda p=prober: bool(p.got), 2)
            # Nobody else ever held it while its holder did.
            assert min(prober.got) > released[prober.key], (prober.key, prober.got)

        check_worker(group, journal, sender)
        # The followers first: a leader stopped first releases its lease as it exits, and a
        # follower still running would then lead (and log it) before it is stopped.
        for beat in sorted(beats, key=lambda b: " is the leader " in b.log()):
            beat.stop()
        check_beats(journal, switched, beats)
    finally:
        for prober in probers:
            prober.stop()
        for beat in beats:
            beat.stop()
        worker.stop()
        for lease in leases.values():
            lease.release()


def check_worker(group: Group, journal: Journal, sender: Celery) -> None:
    """One body at a time, even across the switch, never told of a loss; the end-of-task
    release after the switch frees the key on the new master at once."""
    ended = journal.wait_for("end", timeout=BODY + 5, name="fo")
    assert journal.select("lost") == [], journal.select("lost")
    poll("the body's release", lambda: on_master(group.replica.port, "failover:fo") is None, 2)
    sender.send_task("tests.worker_app.failover_task", ("fo", 0.0))
    journal.wait_for("end", count=2, name="fo", timeout=5)
    spans = intervals(journal.entries(), name="fo")
    assert overlaps(spans) == [], spans
    assert spans[1][0] >= ended[0]["t"]
    assert len(journal.select("contended", policy="drop")) >= HOLD / 0.5 - 2


def check_beats(journal: Journal, switched: float, beats: list[Beat]) -> None:
    """One leader all along (the other never led, and no tick was sent twice); each tick run
    once; ticks still sent after the switch."""
    leaders = [beat for beat in beats if " is the leader " in beat.log()]
    assert len(leaders) == 1, [beat.log() for beat in beats]
    assert [e for e in journal.select("contended") if e["key"].startswith("beat-tick:")] == []
    starts = journal.select("start", name="led")
    assert len({s["beat"] for s in starts}) == 1, Counter(s["beat"] for s in starts)
    assert Counter(s["tick"] for s in starts).most_common(1)[0][1] == 1
    assert [s for s in starts if s["t"] > switched + HOLD / 2]


def test_a_script_refused_readonly_asks_the_sentinels_again(
    group: Group, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 6: with the announcements unheard, a master demoted by ``REPLICAOF`` keeps its
    clients and answers each script ``READONLY`` (a ``ResponseError`` on Redis 6.2). That must
    send the connection back to the sentinels, not leave the lease to expire."""
    monkeypatch.setattr(nodes, "HEAR_SWITCHES", False)
    manager = LockManager(Settings(urls=(group.url,)))
    lease = manager.acquire("ro", ttl=3)
    try:
        poll("the lock to reach the replica", lambda: on_master(group.replica.port, "ro"))
        group.switch()
        group.demote_by_hand()
        renewals = lease.renewals
        # Renewed on the new master: two more renewals within one ttl.
        poll("renewals on the new master", lambda: lease.renewals >= renewals + 2, 3)
        lease.ensure()
        old = redis.Redis(port=group.master.port, socket_timeout=5)
        try:
            with pytest.raises(redis.exceptions.ReadOnlyError):
                old.set("dlock:{x}", 1)
        finally:
            old.close()
    finally:
        lease.release()
        manager.close()
    assert on_master(group.replica.port, "ro") is None


def test_a_reply_less_release_refused_readonly_reaches_the_new_master(
    group: Group, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the announcements unheard, a master demoted by ``REPLICAOF`` refuses the
    end-of-task release (``wait=False``, no reply read) with ``READONLY``. The release must
    still free the key on the new master, even when the thread's next command (the next
    task's acquire) comes at once."""
    monkeypatch.setattr(nodes, "HEAR_SWITCHES", False)
    manager = LockManager(Settings(urls=(group.url,)))
    try:
        lease = manager.acquire("ro-release", ttl=30)
        poll("the lock to reach the replica", lambda: on_master(group.replica.port, "ro-release"))
        group.switch()
        group.demote_by_hand()
        lease.release(wait=False)
        manager.acquire("ro-next", ttl=30, renew=False).release()
        poll(
            "the release to reach the new master",
            lambda: on_master(group.replica.port, "ro-release") is None,
            3,
        )
    finally:
        manager.close()


def test_a_child_forked_between_two_failovers_follows_the_second(group: Group) -> None:
    """A pool process forked after its parent heard one failover inherits what the parent
    heard. If a second failover (back to the first master) happens before the child first
    uses the lock, and so before it subscribes, the child must follow the sentinels to the
    master they name now: it missed that announcement, but a master announced before it
    must not be held against a newer one for ever."""
    manager = LockManager(Settings(urls=(group.url,)))
    node = manager.nodes[0]
    assert isinstance(node, nodes.SentinelNode)
    try:
        manager.acquire("fork-a", ttl=5, renew=False).release()  # subscribes this process
        group.switch()
        poll("the switch to be heard", lambda: node.announced == ("127.0.0.1", group.replica.port))
        group.demote_by_hand()
        go_read, go_write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through its exit status
            code = 3
            try:
                os.close(go_write)
                os.read(go_read, 1)  # until the second failover is done
                deadline = time.monotonic() + 5
                code = 1
                while time.monotonic() < deadline:
                    try:
                        manager.acquire("fork-b", ttl=5, renew=False).release()
                    except LockUnavailable:
                        time.sleep(0.1)  # the retry rate of a caller, not synchronisation
                        continue
                    code = 0
                    break
            finally:
                os._exit(code)
        os.close(go_read)
        group.switch_back()
        os.write(go_write, b"x")
        os.close(go_write)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child never reached the master"
        back = ("127.0.0.1", group.master.port)
        poll("the second switch heard here", lambda: node.announced == back)
        manager.acquire("fork-c", ttl=5, renew=False).release()
    finally:
        manager.close()
