"""What a lock leaves on the server and costs it as work grows (issue 34), on real servers.

Each test reads the server's own account (key ttls, the slow log, ``CLIENT LIST``,
``INFO commandstats``), never a timing of this host: the figures are counts.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from celery_dlock.backends.redis.redlock import LockManager
from celery_dlock.core.config import Settings
from celery_dlock.core.errors import LockContended
from celery_dlock.core.lease import Lease
from tests.support.clients import client
from tests.support.waiting import command_counts, commands_since, taking_thread

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


def test_nobody_waiting_a_release_writes_no_wake_up_and_a_refusal_writes_nothing(
    single_urls: list[str], manager: LockManager
) -> None:
    plain = client(single_urls[0])
    manager.acquire("warm", ttl=5, renew=False).release()  # scripts cached, connection open
    before = command_counts(plain)
    manager.acquire("quiet", ttl=5, renew=False).release()
    cycle = commands_since(plain, before)
    assert plain.exists("dlock:{quiet}:signal") == 0, "a wake-up written for nobody"
    # acquire: EVALSHA STRLEN GET EXISTS GET TIME SET SET (STRLEN: the value's size is known
    # before it is read, so a huge foreign value is never copied whole); release: EVALSHA GET
    # DEL EXISTS
    assert sum(cycle.values()) - cycle.get("info", 0) == 12, cycle
    holder = manager.acquire("hot", ttl=5, renew=False)
    try:
        before = command_counts(plain)
        with pytest.raises(LockContended):
            manager.acquire("hot", ttl=5, wait=0, renew=False)
        refusal = commands_since(plain, before)
    finally:
        holder.release()
    # EVALSHA STRLEN GET PTTL: no void marker read, nothing written
    assert {k: v for k, v in refusal.items() if k != "info"} == {
        "evalsha": 1,
        "strlen": 1,
        "get": 1,
        "pttl": 1,
    }, refusal


def test_a_waiter_is_woken_by_the_release_not_by_its_timeout(
    single_urls: list[str], manager: LockManager
) -> None:
    # The release wakes a waiter only while a refusal's waiter marker says one may be
    # blocked: the waiter must get in long before the holder's ttl would have let it.
    holder = manager.acquire("handed", ttl=60, renew=False)
    thread, got = taking_thread(manager, "handed", ttl=5, wait=60, renew=False)
    thread.start()
    plain = client(single_urls[0])
    deadline = time.monotonic() + 10
    while not any(c["cmd"] == "blpop" for c in plain.client_list()):
        assert time.monotonic() < deadline, "the waiter never blocked"
    released = time.monotonic()
    holder.release()
    thread.join(30)
    assert got, "the waiter did not get the key within 30 s of the release"
    assert got[0] - released < 30  # the holder's ttl (60 s) would have been the other way


def test_redlock_writes_a_fence_back_only_to_nodes_below_the_token(
    redlock_urls: list[str],
) -> None:
    made = LockManager(Settings(urls=redlock_urls))
    try:
        made.acquire("warm", ttl=5, renew=False).release()
        plains = [client(u) for u in redlock_urls]
        before = [command_counts(p) for p in plains]
        # A fresh key: every node starts its counter at its own clock, so they disagree.
        lease = made.acquire("fresh", ttl=5, renew=False)
        pairs = zip(plains, before, strict=True)
        scripts = [commands_since(p, b).get("evalsha", 0) for p, b in pairs]
        lease.release()
    finally:
        made.close()
    counters = sorted(scripts)
    # Each node ran the acquire; all but the node that issued the token ran the write-back.
    assert counters.count(1) >= 1, scripts
    assert sum(scripts) <= 2 * len(plains) - 1, scripts


def test_a_redlock_waiter_that_took_a_node_the_holder_lacks_is_still_woken(
    redlock_urls: list[str],
) -> None:
    # The holder's key is missing on the first node: the waiter takes that node (then undoes
    # it) and is refused by the others. It must block where a refusal left the waiter marker,
    # or the holder's release wakes nobody and it waits out the holder's 60 s ttl.
    made = LockManager(Settings(urls=redlock_urls))
    holder = made.acquire("partial", ttl=60, renew=False)
    client(redlock_urls[0]).delete("dlock:{partial}")
    got: list[bool] = []

    def waiter() -> None:
        made.acquire("partial", ttl=5, wait=60, renew=False).release()
        got.append(True)

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not any(
            c["cmd"] == "blpop" for url in redlock_urls for c in client(url).client_list()
        ):
            assert time.monotonic() < deadline, "the waiter never blocked"
        holder.release()
        thread.join(20)  # a third of the holder's ttl: a wake-up, not the expiry
        assert got == [True], "the waiter was not woken by the release"
    finally:
        thread.join(60)
        made.close()


def _blocked(plain: redis.Redis) -> int:
    return sum(1 for c in plain.client_list() if c["cmd"] == "blpop")


def test_a_shorter_refusal_never_cuts_the_waiter_marker_another_waiter_relies_on(
    single_urls: list[str], manager: LockManager
) -> None:
    # B blocks until the first holder's expiry (60 s away). The key passes to W (woken first)
    # with a 2 s ttl; C, a caller with a 1 s ttl, is refused by W and gives up. C's refusal
    # must not shorten the marker B's refusal set: W's release, once C's marker would have
    # expired, must still wake B, not leave it blocked until the first holder's old expiry.
    plain = client(single_urls[0])
    first = manager.acquire("mixed", ttl=60, renew=False)
    woken: list[float] = []
    w_holds = threading.Event()
    w_may_release = threading.Event()

    def w() -> None:
        lease = manager.acquire("mixed", ttl=2, wait=90)  # renewed while held
        w_holds.set()
        w_may_release.wait(30)
        lease.release()

    def b() -> None:
        manager.acquire("mixed", ttl=60, wait=90, renew=False).release()
        woken.append(time.monotonic())

    threads = [threading.Thread(target=w), threading.Thread(target=b)]
    try:
        for n, thread in enumerate(threads, 1):  # W blocks first: the release wakes W
            thread.start()
            deadline = time.monotonic() + 10
            while _blocked(plain) < n:
                assert time.monotonic() < deadline, "the waiter never blocked"
        first.release()
        assert w_holds.wait(10), "W was not woken by the first release"
        with pytest.raises(LockContended):
            manager.acquire("mixed", ttl=1, wait=0.2, renew=False)
        # W holds past what C's refusal alone sets the marker for (W's time left, at most
        # 2 s, plus 1 s): time the test's ttls control, not host speed.
        time.sleep(3.5)
        released = time.monotonic()
        w_may_release.set()
        threads[0].join(10)
        threads[1].join(20)
        assert woken, "B was not woken by W's release within 20 s (it waits out 60 s)"
        assert woken[0] - released < 20
    finally:
        w_may_release.set()
        for thread in threads:
            thread.join(70)


def test_a_forced_release_after_the_fence_counter_expired_never_lowers_the_token(
    redlock_urls: list[str],
) -> None:
    # A lease held longer than the fence retention (one day by default) outlives its counter
    # (deleted here: what its expiry does). An operator's forced release then must not start
    # a counter at 1: Redlock floors only a missing counter at the clock, so the next token
    # would be 2, far below the revoked holder's, the very holder fencing exists to shut out.
    made = LockManager(Settings(urls=redlock_urls))
    try:
        lease = made.acquire("long", ttl=60, renew=False)
        for url in redlock_urls:  # what the retention's expiry does while the lease is held
            client(url).delete("dlock:{long}:fence")
        holder = made.holder("long")
        assert holder is not None
        assert made.force_release("long", holder)
        after = made.acquire("long", ttl=5, renew=False)
        try:
            assert after.token > lease.token, (after.token, lease.token)
        finally:
            after.release()
        lease.release()
    finally:
        made.close()


def test_a_redlock_fence_write_back_keeps_the_acquisitions_own_retention(
    redlock_urls: list[str],
) -> None:
    # A one-shot key (beat's tick keys) asks for a counter kept only as long as the key. On a
    # fresh key the nodes' counters disagree (each starts at its own clock), and the ones
    # below the token are written back: with that same retention, not the default day.
    made = LockManager(Settings(urls=redlock_urls))
    try:
        made.acquire("tick", ttl=5, renew=False, fence_retention=5).release()
        ttls = [client(u).pttl("dlock:{tick}:fence") for u in redlock_urls]
    finally:
        made.close()
    assert all(ttl <= 5000 for ttl in ttls), f"fence counter ttls (ms): {ttls}"


#: A waiter process that stops itself (SIGSTOP) after its refused attempt, just before it
#: blocks on the signal list: a pause the test then ends with SIGCONT.
_PAUSED_WAITER = """
import os, signal, sys
import celery_dlock.backends.redis.redlock as redlock
from celery_dlock.core.config import Settings
real = redlock.blocking_pop
def paused(node, key, seconds):
    print("blocking", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    return real(node, key, seconds)
redlock.blocking_pop = paused
manager = redlock.LockManager(Settings(urls=sys.argv[1:]))
manager.acquire("paused", ttl=3, wait=None, renew=False).release()
print("got", flush=True)
"""


def _process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``T``: stopped by a signal), from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("nodes", [1, 3])
def test_a_waiter_paused_past_the_marker_still_gets_the_key_when_its_block_ends(
    nodes: int, single_urls: list[str], redlock_urls: list[str]
) -> None:
    # docs/guarantees.md: a waiter paused for more than a second between its refusal and its
    # block can miss the release, and then gets the key when its block (the holder's time
    # left, 3 s at most here) times out: late, never not at all, with wait=None too.
    urls = single_urls if nodes == 1 else redlock_urls[:3]
    made = LockManager(Settings(urls=urls))
    holder = made.acquire("paused", ttl=3)  # renewed while the waiter is stopped
    child = subprocess.Popen(
        [sys.executable, "-c", _PAUSED_WAITER, *urls], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "blocking"
        # Stopped before going on: a SIGCONT sent before its SIGSTOP would be lost.
        deadline = time.monotonic() + 10
        while _process_state(child.pid) != "T":
            assert time.monotonic() < deadline, "the waiter never stopped itself"
            time.sleep(0.02)
        plains = [client(u) for u in urls]
        if nodes == 1:
            # On one node, whose waiter looks again with a bare PTTL between blocks, the
            # marker lasts MARKER_BLOCKS blocks of 3 s plus 1 s: its expiry is done by hand.
            assert plains[0].delete("dlock:{paused}:waiting") == 1
        # On Redlock the marker lasts the 3 s ttl plus 1 s.
        deadline = time.monotonic() + 3 + 1 + 10
        while any(p.exists("dlock:{paused}:waiting") for p in plains):
            assert time.monotonic() < deadline, "the waiter marker never expired"
            time.sleep(0.05)
        holder.release()  # wakes nobody: the marker is gone
        released = time.monotonic()
        os.kill(child.pid, signal.SIGCONT)
        ready, _, _ = select.select([child.stdout], [], [], 3 + 10)
        assert ready, "the paused waiter never got the key"
        assert child.stdout.readline().strip() == "got"
        assert time.monotonic() - released < 3 + 10
        assert child.wait(10) == 0
    finally:
        holder.release()
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
        made.close()


#: The holder's ttl in the look tests: each look comes at the latest this long after the one
#: before. The test renews the key every RENEW_EVERY s, so only a stall of the test process
#: longer than the difference (2.3 s) lets the holder expire under the waiter.
LOOK_TTL_MS = 2400
RENEW_EVERY = 0.1
#: The holder's lease is taken for this long, and its key then kept at LOOK_TTL_MS by hand.
#: A lease taken for LOOK_TTL_MS would run out of validity in this process while the test
#: keeps its key: once a lease's validity has run out, this process deletes the key if it still
#: holds the lease's nonce (the lease is lost, its key freed), and the waiter then got in. That
#: happened only where an earlier test in the same process had started the thread that does it.
HOLDER_TTL = 60


class _Renewer:
    """A thread that keeps ``key`` alive with a plain ``PEXPIRE`` (so every other command the
    server counts is the waiter's) until stopped; it records whether the key ever went
    missing and, if so, what the server and the thread saw then (the longest gap between two
    renewals, the server's expired keys and the commands it ran since the start), so that a
    failure says whether this process stalled or something took the key."""

    def __init__(self, plain: redis.Redis, key: str) -> None:
        self.plain = plain
        self.key = key
        self.stop = threading.Event()
        self.missed = 0
        self.last = time.monotonic()
        self.longest_gap = 0.0
        self.evidence = ""
        self.start = command_counts(plain)
        self.expired = int(plain.info("stats")["expired_keys"])
        assert plain.pexpire(key, LOOK_TTL_MS), f"{key} is not held"
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(RENEW_EVERY):
            if self.plain.pexpire(self.key, LOOK_TTL_MS):
                now = time.monotonic()
                self.longest_gap = max(self.longest_gap, now - self.last)
                self.last = now
            else:
                self.missed += 1
                if not self.evidence:
                    gap = time.monotonic() - self.last
                    expired = int(self.plain.info("stats")["expired_keys"]) - self.expired
                    self.evidence = (
                        f"; {gap:.2f} s since the last renewal, {expired} keys expired since "
                        f"the start, commands since: {commands_since(self.plain, self.start)}"
                    )

    def end(self) -> None:
        self.stop.set()
        self.thread.join(10)

    def alive(self) -> str:
        """The premise of a look test, as the failure message it needs."""
        return (
            f" (longest gap between renewals {self.longest_gap:.2f} s)" if not self.missed
            else f" (the holder's key went missing{self.evidence})"
        )  # fmt: skip


def _blocked_once(plain: redis.Redis, before: dict[str, int]) -> None:
    deadline = time.monotonic() + 10
    while not commands_since(plain, before).get("blpop", 0):
        assert time.monotonic() < deadline, "the waiter never blocked"
        time.sleep(0.02)


def _looks(plain: redis.Redis, before: dict[str, int], looks: int, renewer: _Renewer) -> None:
    """Return once the waiter blocked ``looks`` times more (each block ends at the latest one
    ttl after the one before it)."""
    deadline = time.monotonic() + looks * LOOK_TTL_MS / 1000 + 10
    while commands_since(plain, before).get("blpop", 0) < looks:
        assert time.monotonic() < deadline, "the waiter stopped looking" + renewer.alive()
        time.sleep(0.05)


def test_a_waiter_looks_again_with_one_command_while_the_holder_renews(
    single_urls: list[str], manager: LockManager
) -> None:
    # A waiter blocks until the expiry the holder's key showed it, then looks again. While
    # the holder lives, that look is one PTTL (the BLPOP aside), not a full acquire script
    # (EVALSHA STRLEN GET PTTL PTTL SET): the waiter marker lasts many blocks, and is set
    # again only near its end.
    plain = client(single_urls[0])
    holder = manager.acquire("looked", ttl=HOLDER_TTL, renew=False)
    renewer = _Renewer(plain, "dlock:{looked}")
    done: list[bool] = []

    def waiter() -> None:
        manager.acquire("looked", ttl=5, wait=None, renew=False).release()
        done.append(True)

    thread = threading.Thread(target=waiter)
    start = command_counts(plain)
    thread.start()
    try:
        _blocked_once(plain, start)
        before = command_counts(plain)
        _looks(plain, before, 4, renewer)
        seen = commands_since(plain, before)
    finally:
        renewer.end()
        plain.delete("dlock:{looked}")  # the holder is gone; the waiter gets in at its look
        thread.join(10)
        holder.release()
    assert done == [True]
    assert not renewer.missed, renewer.alive()
    blocks = seen.pop("blpop")
    # The test's own: INFO (these counts), PEXPIRE (the renewals), HELLO (a new connection).
    waiter_sent = {k: v for k, v in seen.items() if k not in ("info", "pexpire", "hello")}
    # One look between two blocks, and at most one full attempt (6 commands) in the window,
    # where the marker is set again.
    assert sum(waiter_sent.values()) <= blocks + 6, (blocks, waiter_sent)
    assert waiter_sent.get("evalsha", 0) <= 1, (blocks, waiter_sent)


def test_a_release_wakes_a_waiter_that_looked_with_pttl_for_longer_than_one_block(
    single_urls: list[str], manager: LockManager
) -> None:
    # The waiter marker must outlast every block the waiter made after a bare PTTL look: a
    # release after several of them still writes the wake-up, and the waiter takes it.
    plain = client(single_urls[0])
    holder = manager.acquire("woken", ttl=HOLDER_TTL, renew=False)
    renewer = _Renewer(plain, "dlock:{woken}")
    got: list[Lease] = []
    thread = threading.Thread(target=lambda: got.append(manager.acquire("woken", ttl=1, wait=None)))
    start = command_counts(plain)
    thread.start()
    try:
        _blocked_once(plain, start)
        before = command_counts(plain)
        # Three blocks, about 7 s: a marker of one block (the holder's 2.4 s) plus 1 s, as
        # every refusal set it before the waiter looked with PTTL, would be gone.
        _looks(plain, before, 3, renewer)
        looked = commands_since(plain, before)
        renewer.end()
        before = command_counts(plain)
        holder.release()
        pushed = commands_since(plain, before).get("rpush", 0)
        thread.join(10)
        unclaimed = plain.llen("dlock:{woken}:signal")
    finally:
        renewer.end()
        thread.join(10)
        for lease in got:
            lease.release()
    assert not renewer.missed, renewer.alive()
    assert looked.get("evalsha", 0) == 0, f"the waiter looked by full attempts: {looked}"
    assert pushed == 1, "the release wrote no wake-up: the waiter marker was gone"
    assert got, "the waiter never got the key"
    assert unclaimed == 0, "the waiter did not take the wake-up"


def test_a_waiter_that_looked_with_pttl_gets_a_dead_holders_key_at_its_expiry(
    single_urls: list[str], manager: LockManager
) -> None:
    # The holder stops renewing (it died): the waiter's block ends at the expiry its last
    # look saw, and it takes the key then, not a block of its own ttl (8 s) or a marker's
    # life later.
    plain = client(single_urls[0])
    holder = manager.acquire("dies", ttl=HOLDER_TTL, renew=False)
    renewer = _Renewer(plain, "dlock:{dies}")
    thread, got = taking_thread(manager, "dies", ttl=8, wait=None, renew=False)
    start = command_counts(plain)
    thread.start()
    try:
        _blocked_once(plain, start)
        _looks(plain, command_counts(plain), 2, renewer)
    finally:
        renewer.end()
    expiry = renewer.last + LOOK_TTL_MS / 1000  # the key expires by then at the latest
    thread.join(30)
    holder.release()  # the key is the waiter's now, or gone: this deletes nothing
    assert not renewer.missed, renewer.alive()
    assert got, "the waiter never got the dead holder's key"
    # At the expiry plus the look's round trips; a block of the waiter's own ttl would be 8 s.
    assert got[0] - expiry < 4, got[0] - expiry


def test_a_waiter_marker_lasts_no_longer_than_the_wait_beyond_one_block(
    single_urls: list[str], manager: LockManager
) -> None:
    # docs/guarantees.md: on one Redis a refusal's marker covers up to ten blocks, but not
    # more than the caller's wait: a caller that waits half a second leaves no 5 s marker.
    plain = client(single_urls[0])
    holder = manager.acquire("brief", ttl=60, renew=False)  # a holder with a minute left
    try:
        with pytest.raises(LockContended):
            manager.acquire("brief", ttl=5, wait=0.5, renew=False)
        left = plain.pttl("dlock:{brief}:waiting")
    finally:
        holder.release()
    # One block (the holder's minute) + the wait (0.5 s) + 1 s, from the last refusal.
    assert 0 < left <= 60_000 + 500 + 1000, left
