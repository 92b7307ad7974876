"""Trying to break the single-Redis waiter's bare-PTTL look (issue 34) as a deployment would.

Since df7d108 a waiter on one Redis whose block on the signal list times out while the holder
lives looks again with one ``PTTL`` and blocks again, for as long as the waiter marker (which
makes releases write a wake-up) outlasts the next block. Each test here drives real
redis-server, real threads and real processes at one of the promises of docs/guarantees.md
("Waiting") and asserts it, with deadlines from the ttls the test sets.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from celery_dlock.backends.redis.redlock import LockManager
from celery_dlock.core.config import Settings
from celery_dlock.core.errors import LockContended
from celery_dlock.core.lease import Lease
from tests.support.clients import client
from tests.support.cluster import Cluster, redis_cluster
from tests.support.waiting import command_counts, commands_since, taking_thread


@pytest.fixture
def manager(single_urls: list[str]) -> Iterator[LockManager]:
    made = LockManager(Settings(urls=single_urls))
    yield made
    made.close()


def _wait_until(what: str, done: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _blocked(plain: redis.Redis) -> int:
    return int(plain.info("clients")["blocked_clients"])


#: The ttl of a holder that renews (or dies) while waiters look again: each of their blocks
#: ends by its expiry.
DEAD_TTL = 2.0
#: The crowd's ttl, below the holder's: each waiter's block then lasts the holder's time left,
#: and its marker is counted in those blocks (a longer ttl would stretch it).
CROWD_TTL = 1


def test_sixteen_waiters_are_each_woken_by_one_release_and_nobody_is_stuck(
    single_urls: list[str], manager: LockManager
) -> None:
    # docs/guarantees.md: one release wakes exactly one waiter (no herd), and no waiter polls.
    # Sixteen threads wait on one key whose holder renews a 2 s lease, until each has looked
    # again with PTTL after timed-out blocks; the waiter marker must outlast those looks, so
    # that from the holder's release on each release writes one wake-up and hands the key to
    # the next waiter, and the server sees one acquire attempt per hand-over, not one per
    # waiter. (Seen failing with MARKER_BLOCKS = 1 and no marker check in _look_again: the
    # marker was gone, -2, when the holder released.)
    plain = client(single_urls[0])
    holder = manager.acquire("crowd", ttl=DEAD_TTL)  # renewed by this process's watchdog
    events: list[tuple[str, float]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def waiter() -> None:
        try:
            lease = manager.acquire("crowd", ttl=CROWD_TTL, wait=None, renew=False)
            with lock:
                events.append(("got", time.monotonic()))
            time.sleep(0.02)  # the work under the lock, not a synchronisation
            with lock:
                events.append(("released", time.monotonic()))
            lease.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=waiter) for _ in range(16)]
    for thread in threads:
        thread.start()
    try:
        start = command_counts(plain)
        _wait_until("the sixteen waiters never all blocked", lambda: _blocked(plain) >= 16, 30)
        # Each block ends by the holder's expiry (DEAD_TTL), then a PTTL look: four blocks
        # each, longer than a marker of one block plus a second (3 s) would last.
        _wait_until(
            "the waiters never looked again",
            lambda: (
                commands_since(plain, start).get("blpop", 0) >= 4 * 16 and _blocked(plain) >= 16
            ),
            4 * DEAD_TTL + 30,
        )
        marker_left = plain.pttl("dlock:{crowd}:waiting")
        before = command_counts(plain)
        with lock:
            events.append(("released", time.monotonic()))
        holder.release()
        for thread in threads:
            thread.join(16 * DEAD_TTL + 10)
        seen = commands_since(plain, before)
    finally:
        holder.release()
    assert not errors, errors
    assert marker_left > 0, "the waiter marker expired while the waiters looked with PTTL"
    gots = [t for what, t in events if what == "got"]
    assert len(gots) == 16, f"only {len(gots)} of 16 waiters got the key"
    # Each hand-over: from a release to the next acquisition; a missed wake-up costs the rest
    # of a block (up to DEAD_TTL after the holder's release), and shows in the counts below.
    # Never two holders at once: "got" and "released" alternate, from the holder's release.
    kinds = [what for what, _ in events]
    assert kinds == ["released", "got"] * 16 + ["released"], kinds
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(events) if a[0] == "released"]
    assert max(gaps) < DEAD_TTL, f"a hand-over took {max(gaps):.1f} s: {gaps}"
    # 17 releases (EVALSHA of RELEASE), each writing one wake-up (RPUSH: the marker outlasted
    # the looks), and 16 winning attempts; a herd would add an attempt per waiter per release
    # (over a hundred), a marker gone before the holder's release fifteen refusals.
    assert seen.get("rpush", 0) == 17, seen
    assert seen.get("evalsha", 0) <= 17 + 16 + 8, seen


#: A holder process: takes the key with a short ttl, renewed by its own watchdog, says so,
#: and lives until the test kills it (SIGKILL: no release, no last renewal).
_HOLDER = """
import sys, threading
from celery_dlock.backends.redis.redlock import LockManager
from celery_dlock.core.config import Settings
manager = LockManager(Settings(urls=sys.argv[2:]))
lease = manager.acquire(sys.argv[1], ttl=2)
print("held", flush=True)
threading.Event().wait()
"""


def _holder_process(key: str, urls: list[str]) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, key, *urls], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


def _state(pid: int) -> str:
    """The process's state letter from /proc (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def _end(child: subprocess.Popen[str]) -> None:
    child.kill()
    child.wait()
    if child.stdout is not None:
        child.stdout.close()


def test_a_killed_holders_waiters_get_the_key_at_its_expiry_and_a_short_wait_ends_on_time(
    single_urls: list[str], manager: LockManager
) -> None:
    # docs/guarantees.md: a dead holder's waiters are admitted when its lease expires, not a
    # block of their own ttl (8 s) or a marker's life later; with wait=W a waiter gives up by
    # W with LockContended. A holder process renewing a 2 s lease is SIGKILLed while two
    # waiters look again with PTTL: one with wait=None, one with wait=3 beside it.
    plain = client(single_urls[0])
    child = _holder_process("dead", single_urls)
    got: list[float] = []
    gave_up: list[tuple[BaseException, float]] = []

    def patient() -> None:
        lease = manager.acquire("dead", ttl=8, wait=None, renew=False)
        got.append(time.monotonic())
        lease.release()

    def impatient() -> None:
        begun = time.monotonic()
        try:
            manager.acquire("dead", ttl=8, wait=3, renew=False).release()
        except BaseException as exc:
            gave_up.append((exc, time.monotonic() - begun))

    threads = [threading.Thread(target=patient), threading.Thread(target=impatient)]
    start = command_counts(plain)
    try:
        for thread in threads:
            thread.start()
        # The impatient waiter gave up, and the patient one blocked again after a look (the
        # holder renews every 2/3 s, so each block ends within 2 s).
        _wait_until(
            "the waiters never looked again",
            lambda: commands_since(plain, start).get("blpop", 0) >= 4 and len(gave_up) == 1,
            3 * DEAD_TTL + 10,
        )
        killed = time.monotonic()
        child.kill()
        for thread in threads:
            thread.join(8 + 10)
    finally:
        _end(child)
    exc, took = gave_up[0]
    assert isinstance(exc, LockContended), repr(exc)
    # Not past the wait by more than a stall of this busy host could explain (a block decided
    # without the wait's end would overrun it by up to DEAD_TTL).
    assert 3 <= took < 3 + 1.5, f"wait=3 gave up after {took:.2f} s"
    assert got, "the patient waiter never got the dead holder's key"
    # The key expires by killed + DEAD_TTL; a block of the waiter's own ttl would be 8 s.
    assert got[0] - killed < 2 * DEAD_TTL, got[0] - killed


#: A waiter process that stops itself (SIGSTOP) right after its first bare PTTL look, before
#: the block that look decided on: a pause the test ends with SIGCONT.
_LOOKING_WAITER = """
import os, signal, sys
import celery_dlock.backends.redis.redlock as redlock
from celery_dlock.core.config import Settings
real = redlock.time_left
looks = []
def looked(node, key):
    left = real(node, key)
    looks.append(left)
    if len(looks) == 1:
        print("looked", left, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    return left
redlock.time_left = looked
manager = redlock.LockManager(Settings(urls=sys.argv[2:]))
manager.acquire(sys.argv[1], ttl=1, wait=None, renew=False).release()
print("got", flush=True)
"""


@pytest.mark.parametrize("marker", ["kept", "gone"])
def test_a_waiter_paused_right_after_a_look_gets_the_key_within_one_block(
    marker: str, single_urls: list[str], manager: LockManager
) -> None:
    # docs/guarantees.md: a waiter whose process pauses between a look and its block may
    # miss a release but gets the key when its block times out. The waiter stops right
    # after a PTTL look that saw the renewed holder (at most DEAD_TTL left); the holder
    # releases meanwhile, with the waiter marker still there ("kept": the release writes a
    # wake-up the waiter finds when it blocks) or gone ("gone": as after a pause longer than
    # the marker; nobody is woken). Either way the waiter has the key within one block.
    plain = client(single_urls[0])
    holder = manager.acquire("stopped", ttl=DEAD_TTL)  # renewed by this process's watchdog
    child = subprocess.Popen(
        [sys.executable, "-c", _LOOKING_WAITER, "stopped", *single_urls],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline().split()
        assert line[0] == "looked", line
        assert 0 < int(line[1]) <= DEAD_TTL * 1000, line
        # It printed before stopping itself: a SIGCONT sent before the stop would be lost.
        _wait_until("the waiter never stopped", lambda: _state(child.pid) == "T", 10)
        if marker == "gone":
            assert plain.delete("dlock:{stopped}:waiting") == 1
        holder.release()
        os.kill(child.pid, signal.SIGCONT)
        resumed = time.monotonic()
        answer = child.stdout.readline().strip()
        took = time.monotonic() - resumed
        assert answer == "got", answer
        assert child.wait(10) == 0
    finally:
        holder.release()
        _end(child)
    # The block the look decided on ends by DEAD_TTL after the look (a block of the waiter's
    # own ttl would be 8 s).
    assert took < DEAD_TTL + 2, took


def test_a_forced_release_mid_wait_wakes_one_waiter_and_the_other_follows(
    single_urls: list[str], manager: LockManager
) -> None:
    # `celery dlock release` (force_release) frees a key whose holder renews it while two
    # waiters (ttl=60) look again with PTTL: one is woken at once, and the other gets the key
    # when the first releases it, not at the end of a block of the first one's minute.
    plain = client(single_urls[0])
    held = manager.acquire("forced", ttl=DEAD_TTL)  # renewed by this process's watchdog
    got: list[float] = []
    lock = threading.Lock()

    def waiter() -> None:
        lease: Lease = manager.acquire("forced", ttl=60, wait=None, renew=False)
        with lock:
            got.append(time.monotonic())
        lease.release()

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        start = command_counts(plain)
        _wait_until(
            "the waiters never looked again",
            lambda: commands_since(plain, start).get("blpop", 0) >= 2 * 2 and _blocked(plain) >= 2,
            2 * DEAD_TTL + 30,
        )
        holder = manager.holder("forced")
        assert holder is not None
        forced = time.monotonic()
        assert manager.force_release("forced", holder)
        for thread in threads:
            thread.join(60 + 10)
    finally:
        held.release()
    assert len(got) == 2, got
    assert max(got) - forced < 60 / 6, [t - forced for t in got]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with redis_cluster(3) as started:
        yield started


def test_on_a_cluster_a_release_after_pttl_looks_wakes_the_waiter(cluster: Cluster) -> None:
    # Redis Cluster waiters look again with PTTL too (on the master of the key's slot): after
    # four blocks of looks at a renewing holder, its marker is still there, the release
    # writes one wake-up there, and the waiter takes the key at once, not at a block's end.
    cluster.flush()
    manager = LockManager(Settings(urls=[cluster.url]))
    owner = next(m for m in cluster.masters if m.port == cluster.owner("dlock:{shard}"))
    plain = cluster.client(owner)
    holder = manager.acquire("shard", ttl=DEAD_TTL)  # renewed by this process's watchdog
    thread, got = taking_thread(manager, "shard", ttl=1, wait=None, renew=False)
    start = command_counts(plain)
    thread.start()
    try:
        _wait_until(
            "the waiter never looked again",
            lambda: commands_since(plain, start).get("blpop", 0) >= 4 and _blocked(plain) >= 1,
            4 * DEAD_TTL + 30,
        )
        looked = commands_since(plain, start)
        marker_left = plain.pttl("dlock:{shard}:waiting")
        before = command_counts(plain)
        released = time.monotonic()
        holder.release()
        thread.join(DEAD_TTL + 10)
        pushed = commands_since(plain, before).get("rpush", 0)
    finally:
        holder.release()
        plain.close()
        manager.close()
    assert looked.get("pttl", 0) >= 3, looked
    assert marker_left > 0, "the waiter marker expired while the waiter looked with PTTL"
    assert pushed >= 1, "the release wrote no wake-up"
    assert got, "the waiter never got the key"
    # A block ends by the holder's expiry (DEAD_TTL): woken by the release, it is far sooner.
    assert got[0] - released < DEAD_TTL * 0.75, got[0] - released
