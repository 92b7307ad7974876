"""A stateful fault model of Redlock over real 3- and 5-node sets (hypothesis).

Hypothesis draws sequences of steps — acquire, release (waited or not), renew, let time pass,
pause / resume a node (SIGSTOP / SIGCONT), stop it, start it empty or with its data (an
append-only file fsynced on every write), flush it — and after every step checks:

1. **One holder at a time**: at most one lease believes itself valid at any instant, unless
   a wipe (an empty start or a flush: the documented condition that lets a second client in)
   took a copy of the older one's key and left it on a minority of nodes. Copies are tracked
   with their expiry: a copy a renewal missed expires there before the lease's validity ends,
   so a wipe of another node can leave the lease a minority long after the wipe.
2. **Fencing**: every acquisition's token is greater than every earlier one.
3. **Liveness**: a free key (no valid lease; no node that is up holds it) with a healthy
   majority of nodes up is acquired within one cool-down and one try.
4. **Clean**: once every lease is released (or expired) and every node is up and answering,
   no node holds the key for long (voids and owed deletes land; server expiry).

Profiles: ``DLOCK_STATEFUL_PROFILE=ci`` (the default, about two minutes, a fixed seed so every
run of the suite draws the same sequences) or ``long`` (a random seed). ``DLOCK_STATEFUL_SEED``
sets the seed. A failure prints the seed, the steps that reproduce it (with what each step
saw), and the ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import collections
import itertools
import os
import random
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import hypothesis
import pytest
from celery import Celery
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_dlock import LockContended, LockUnavailable
from celery_dlock.backends.redis.redlock import LockManager
from celery_dlock.core.config import drift
from celery_dlock.core.lease import Lease
from celery_dlock.core.registry import manager_for
from celery_dlock.testing import RedisServer

pytestmark = [pytest.mark.local_redis, pytest.mark.slow]

NODE_TIMEOUT = 0.25
COOL_DOWN = max(0.5, 2 * NODE_TIMEOUT)  # nodes.Node.mark_down
#: How long voids and owed deletes may take to land once every node answers: the janitor's
#: longest backoff (1 s), a node timeout, and slack for a loaded machine.
JANITOR_BOUND = 1.0 + NODE_TIMEOUT + 1.5
#: Longer than JANITOR_BOUND: a key nobody deletes (a phantom a resumed node made) outlives
#: the cleanliness check instead of expiring within it.
TTL = 4.0

PROFILES = {
    # (examples, steps per example) for 3 nodes and for 5
    "ci": {3: (10, 30), 5: (8, 30)},
    "long": {3: (50, 60), 5: (30, 60)},
}
PROFILE = os.environ.get("DLOCK_STATEFUL_PROFILE", "ci")
#: The CI profile's seed, fixed so that every run of the suite draws the same sequences.
CI_SEED = 20261123

_keys = itertools.count()
#: What a run did, printed at its end: sequences, steps, and how acquisitions ended.
_counts: collections.Counter[str] = collections.Counter()


def _watched(lease: Lease, error: Exception) -> None:
    _counts["lost"] += 1


class RedlockModel(RuleBasedStateMachine):
    """One key on N real nodes; see the module docstring."""

    servers: ClassVar[list[RedisServer]] = []
    manager: ClassVar[LockManager]

    def __init__(self) -> None:
        super().__init__()
        self.key = f"model-{os.getpid()}-{next(_keys)}"
        self.leases: list[Lease] = []  # every lease of this example, in acquisition order
        self.excused: set[int] = set()  # tokens of leases that lost their majority to a wipe
        self.wipes: set[int] = set()  # tokens of leases a wipe took a copy from
        self.last_token = 0
        self.paused: set[int] = set()
        self.stopped: set[int] = set()
        #: token -> {node: when (monotonic) its copy of the lease's key expires there}, as
        #: last seen; a copy a renewal missed expires there before the lease's validity ends.
        self.holders: dict[int, dict[int, float]] = {}
        _counts["sequences"] += 1

    # -- set-up ------------------------------------------------------------------------------

    @initialize()
    def fresh(self) -> None:
        for server in self.servers:
            if not server.running:
                server.start()
            if server.paused:
                server.resume()
        for node in self.manager.nodes:
            node._down_until = 0.0
        note(f"key {self.key} on {len(self.servers)} nodes")

    def teardown(self) -> None:
        for lease in self.leases:
            lease.release()
        for server in self.servers:
            if server.paused:
                server.resume()
            if not server.running:
                server.start()

    @property
    def n(self) -> int:
        return len(self.servers)

    @property
    def quorum(self) -> int:
        return self.n // 2 + 1

    def up(self) -> list[int]:
        return [i for i in range(self.n) if i not in self.paused and i not in self.stopped]

    def raw(self, i: int) -> Any:
        import redis

        return redis.Redis(port=self.servers[i].port, socket_timeout=5)

    def held_on(self, i: int) -> bytes | None:
        return self.read(i)[0]

    def read(self, i: int) -> tuple[bytes | None, float]:
        """Node ``i``'s value of the key and when (monotonic, at the latest) it expires."""
        conn = self.raw(i)
        try:
            begun = time.monotonic()
            pipe = conn.pipeline(transaction=False)
            pipe.get(f"dlock:{{{self.key}}}")
            pipe.pttl(f"dlock:{{{self.key}}}")
            value, pttl = pipe.execute()
            return value, begun + max(int(pttl), 0) / 1000.0
        finally:
            conn.close()

    def believed_valid(self) -> list[Lease]:
        return [x for x in self.leases if not x.released and x.valid_for > 0]

    def observe(self) -> None:
        """Where each live lease's key is, and until when: seen on nodes that are up; a
        paused or stopped node keeps what it had (a stopped one in its file) until it expires."""
        values = {i: self.read(i) for i in self.up()}
        for lease in self.believed_valid():
            seen = self.holders.setdefault(lease.token, {})
            for i, (value, expires) in values.items():
                if value is not None and value.startswith(lease.head.encode()):
                    seen[i] = expires
                else:
                    seen.pop(i, None)

    def wiped(self, i: int) -> None:
        """Node ``i`` lost its data: the copies it had are gone."""
        for lease in self.believed_valid():
            seen = self.holders.get(lease.token, {})
            if seen.pop(i, None) is not None:
                self.wipes.add(lease.token)

    def excuse(self, lease: Lease, at: float) -> bool:
        """Whether ``lease``, still valid, may have a successor granted at ``at``: a wipe took
        a copy of its key and it was left on fewer than a majority of nodes (copies a renewal
        missed expire before the lease's validity ends; only a wipe can take it below that).
        """
        if lease.token in self.excused:
            return True
        if lease.token not in self.wipes:
            return False
        alive = sorted(i for i, expires in self.holders[lease.token].items() if expires > at)
        if len(alive) >= self.quorum:
            return False
        self.excused.add(lease.token)
        note(f"lease {lease.token} excused: a wipe left its key on {alive} only")
        return True

    # -- rules -------------------------------------------------------------------------------

    @rule()
    def acquire(self) -> None:
        self.observe()
        before = self.believed_valid()
        try:
            # Watched (on_lost), as a renewed lease is in a process: the renew rule below plays
            # the watchdog's renewals, and the watchdog itself reports and releases the lease
            # when its validity runs out, which owes its delete to nodes a renewal missed.
            lease = self.manager.acquire(self.key, ttl=TTL, renew=False, on_lost=_watched)
            # Every node had run the acquire by now: a copy that expired before is gone.
            granted_at = time.monotonic()
        except (LockContended, LockUnavailable) as exc:
            _counts[type(exc).__name__] += 1
            note(f"acquire refused: {type(exc).__name__}")
            return
        _counts["acquired"] += 1
        note(f"acquired token {lease.token}")
        self.granted(lease, before, granted_at)

    def granted(self, lease: Lease, before: list[Lease], at: float = 0.0) -> None:
        assert lease.token > self.last_token, f"token {lease.token} after {self.last_token}"
        self.last_token = lease.token
        for other in before:
            if other.valid_for > 0 and not self.excuse(other, at):
                raise AssertionError(
                    f"two holders: {lease.token} granted while {other.token} believes itself "
                    f"valid for {other.valid_for:.3f} s on {sorted(self.holders[other.token])}"
                )
        self.leases.append(lease)
        self.holders[lease.token] = {}
        self.observe()

    # Which lease a step acts on is drawn as an index into the leases it may act on now, and
    # these steps have no precondition: what they may act on depends on time and on what
    # earlier steps got from real servers, which differ when hypothesis replays a prefix, and
    # draws whose shape depended on it were a FlakyStrategyDefinition error in a long run.

    @rule(index=st.integers(0, 3), wait=st.booleans())
    def release(self, index: int, wait: bool) -> None:
        candidates = [x for x in self.leases if not x.released]
        if not candidates:
            return
        lease = candidates[index % len(candidates)]
        lease.release(wait=wait)
        note(f"released {lease.token} (wait={wait})")

    @rule(index=st.integers(0, 3))
    def renew(self, index: int) -> None:
        candidates = self.believed_valid()
        if not candidates:
            return
        lease = candidates[index % len(candidates)]
        with lease.io_lock:
            if lease.released:
                return
            reason = self.manager.renew([lease])[0]
        if reason is not None:  # as the watchdog does
            lease.mark_lost(reason)
            self.manager.release(lease)
        note(f"renewed {lease.token}: {reason or 'ok'}")
        self.observe()

    @rule(seconds=st.sampled_from([0.05, 0.3, 1.0, 2.0]))
    def let_time_pass(self, seconds: float) -> None:
        time.sleep(seconds)  # the model's clock: leases and keys age in real time

    @precondition(lambda self: bool(self.up()))
    @rule(data=st.data())
    def pause(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.up()))
        self.servers[i].pause()
        self.paused.add(i)

    @precondition(lambda self: bool(self.paused))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(self.paused)))
        self.servers[i].resume()
        self.paused.discard(i)

    @precondition(lambda self: bool(self.up()))
    @rule(data=st.data())
    def stop(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.up()))
        self.servers[i].stop()  # SIGTERM: the append-only file is complete
        self.stopped.add(i)

    @precondition(lambda self: bool(self.stopped))
    @rule(data=st.data(), empty=st.booleans())
    def start(self, data: st.DataObject, empty: bool) -> None:
        i = data.draw(st.sampled_from(sorted(self.stopped)))
        if empty:
            self.servers[i].restart(wipe=True)  # stopped already: starts without its file
            self.wiped(i)
        else:
            self.servers[i].start()
        self.stopped.discard(i)
        self.observe()

    @precondition(lambda self: bool(self.up()))
    @rule(data=st.data())
    def flush(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.up()))
        conn = self.raw(i)
        try:
            conn.flushall()
        finally:
            conn.close()
        self.wiped(i)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def one_holder_at_a_time(self) -> None:
        _counts["checks"] += 1  # invariants run after every step (and after set-up)
        valid = [x for x in self.believed_valid() if x.token not in self.excused]
        assert len(valid) <= 1, [x.token for x in valid]

    @invariant()
    def a_free_key_with_a_healthy_majority_is_acquirable(self) -> None:
        if self.believed_valid() or len(self.up()) < self.quorum:
            return
        if any(self.held_on(i) is not None for i in self.up()):
            return  # not free: a key the server has not expired yet, or one being undone
        refused: Exception | None = None
        for _ in range(2):
            try:
                lease = self.manager.acquire(self.key, ttl=TTL, renew=False)
            except (LockContended, LockUnavailable) as exc:
                refused = exc
                time.sleep(COOL_DOWN)  # one cool-down, then the one more try
                continue
            self.granted(lease, [])
            lease.release()
            return
        raise AssertionError(f"a free key refused after a cool-down and a retry: {refused}")

    @invariant()
    def no_key_left_once_all_is_released(self) -> None:
        if self.paused or self.stopped or self.believed_valid():
            return
        # Keys of leases that ran out unreleased expire on the server by themselves.
        latest = max(
            (x.deadline + drift(TTL, 0.01) for x in self.leases if not x.released), default=0.0
        )
        deadline = max(latest, time.monotonic()) + JANITOR_BOUND
        while True:
            left = [i for i in range(self.n) if self.held_on(i) is not None]
            if not left:
                return
            assert time.monotonic() < deadline, f"key left on nodes {left}"
            time.sleep(0.02)


@pytest.fixture(scope="module", params=[3, 5], ids=["3-nodes", "5-nodes"])
def model_servers(request: pytest.FixtureRequest) -> Iterator[list[RedisServer]]:
    started: list[RedisServer] = []
    try:
        for _ in range(request.param):  # each started before the next picks a free port
            started.append(RedisServer(appendonly=True, extra_args=["--appendfsync", "always"]))
            started[-1].start()
        yield started
    finally:
        for server in started:
            server.close()


@pytest.mark.timeout(3600)  # a long profile, or shrinking a failure, takes minutes
def test_redlock_under_faults(model_servers: list[RedisServer]) -> None:
    app = Celery("model", set_as_current=False)
    app.conf.dlock_urls = [s.url for s in model_servers]
    app.conf.dlock_node_timeout = NODE_TIMEOUT
    examples, steps = PROFILES[PROFILE][len(model_servers)]
    chosen = os.environ.get("DLOCK_STATEFUL_SEED")
    if chosen is not None:
        seed = int(chosen)
    else:
        seed = CI_SEED if PROFILE == "ci" else random.getrandbits(64)
    print(f"stateful model: profile {PROFILE}, seed {seed} (DLOCK_STATEFUL_SEED={seed})")

    @hypothesis.seed(seed)
    class Model(RedlockModel):
        servers = model_servers
        manager = manager_for(app)

    _counts.clear()
    begun = time.monotonic()
    run_state_machine_as_test(
        Model,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            print_blob=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    print(
        f"stateful model, {len(model_servers)} nodes: {dict(_counts)} in "
        f"{time.monotonic() - begun:.0f} s"
    )


class _Pick:
    """Stands in for hypothesis's ``data`` in a scripted run: every draw gives ``value``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def draw(self, strategy: Any) -> Any:
        return self.value


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> Iterator[RedlockModel]:
    """The model over three fresh nodes, for steps a test scripts itself."""
    monkeypatch.setattr(f"{__name__}.note", print)  # hypothesis's note() needs its run
    servers: list[RedisServer] = []
    try:
        for _ in range(3):  # each started before the next picks a free port
            servers.append(RedisServer(appendonly=True, extra_args=["--appendfsync", "always"]))
            servers[-1].start()
        app = Celery("model-scripted", set_as_current=False)
        app.conf.dlock_urls = [s.url for s in servers]
        app.conf.dlock_node_timeout = NODE_TIMEOUT

        class Scripted(RedlockModel):
            pass

        Scripted.servers = servers
        Scripted.manager = manager_for(app)
        model = Scripted()
        model.fresh()
        yield model
        model.teardown()
    finally:
        for server in servers:
            server.close()


@pytest.mark.timeout(60)
def test_a_wipe_that_leaves_a_lease_a_minority_with_a_lapsed_copy_is_excused(
    scripted: RedlockModel,
) -> None:
    # Found by reading the model (the long profile's 3-node failure in an earlier session was
    # not kept): a renewal misses node 2 (paused), so node 2's copy expires before the lease's
    # validity ends; then node 0 is flushed, and a second client gets nodes 0 and 2 while the
    # first lease is still valid. That is the documented wipe condition (a node back empty at
    # once), but the model remembered node 2 as a holder and called it two holders.
    model = scripted

    def step(rule: Any, *args: Any) -> None:
        rule(*args)
        model.one_holder_at_a_time()

    step(model.acquire)
    first = model.leases[0]
    step(model.let_time_pass, 1.0)
    step(model.pause, _Pick(2))
    step(model.renew, 0)
    step(model.resume, _Pick(2))
    # Past node 2's copy, not past the renewed validity of the lease.
    while time.monotonic() < first.acquired_at + TTL + 0.2:
        time.sleep(0.02)
    assert first.valid_for > 0.3
    step(model.flush, _Pick(0))
    step(model.acquire)
    assert len(model.leases) == 2, "the scenario needs the second lease granted"
    assert first.token in model.excused


@pytest.mark.timeout(60)
def test_a_late_renewal_on_a_resumed_node_is_undone_once_the_lease_ran_out(
    scripted: RedlockModel,
) -> None:
    # Also found by reading the model: a renewal node 0 did not answer (paused) runs there
    # when it resumes and puts the key back for a whole ttl. In a process the watchdog, which
    # sent that renewal, reports the lease lost when its validity runs out and releases it,
    # owing node 0 its delete; the model played the renewal but not the watchdog's release,
    # and found "key left on nodes [0]". Its leases are now watched (on_lost), as in a process.
    model = scripted
    model.acquire()
    lease = model.leases[0]
    model.renew(0)  # node 0 now knows the renewal script: a late one runs there
    model.pause(_Pick(0))
    model.renew(0)
    while lease.valid_for > 0:
        time.sleep(0.02)
    model.resume(_Pick(0))
    model.no_key_left_once_all_is_released()
