"""The connection-fault matrix: every operation that talks to Redis, by every way a connection
dies, on a single Redis and on Redlock over three nodes (the fault on one of them).

Each cell either does its job or reports within its deadline — ``LockUnavailable``,
``LockContended`` at the end of a wait, the lease reported lost, a logged release failure with
the key left to expire — and is never a silent no-op. After the fault is healed, no key of the
cell is left on any node (the janitor's voids and owed releases land). The outcome each cell
must give is read from the table in docs/reliability.md, and a test checks that the table
has exactly this suite's cells.

The faulty node is reached through :class:`tests.support.proxy.FaultProxy`; the servers keep their
data in an append-only file (``restart-aof`` restarts keep it, ``restart-empty`` wipes it).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_dlock import LockContended, LockLost, LockUnavailable, lock
from celery_dlock.backends.redis.janitor import SWEEP_TICK
from celery_dlock.backends.redis.redlock import LockManager
from celery_dlock.backends.redis.resends import CONFIRM_GRACE
from celery_dlock.core.lease import Lease
from celery_dlock.core.registry import manager_for
from celery_dlock.testing import RedisServer
from tests.support.clients import client, idle_timeout
from tests.support.proxy import FaultProxy

pytestmark = [pytest.mark.local_redis, pytest.mark.slow]

OPERATIONS = (
    "acquire",
    "renew",
    "release-waited",
    "release-replyless",
    "blocking-pop",
    "cli-holder",
    "cli-inspect",
    "cli-locks",
)
FAULTS = (
    "idle-timeout",
    "client-kill",
    "reset-mid-reply",
    "blackhole",
    "slow-reply",
    "restart-empty",
    "restart-aof",
    "paused-past-ttl",
)
TOPOLOGIES = ("single", "redlock3")
#: What a cell may come to (the words the docs table uses).
OUTCOMES = ("done", "unavailable", "contended", "lost", "logged")

NODE_TIMEOUT = 0.2
#: Extra time any bound allows on a loaded two-core machine.
SLACK = 1.0
#: Lease length for the operations that do not watch renewals.
TTL = 1.0
#: Renewed leases: the interval exceeds what the server's idle timeout (1 s, counted in whole
#: seconds) takes to close a connection, so the watchdog's is closed between renewals.
RENEW_TTL, RENEW_INTERVAL = 4.8, 2.2
#: Released leases: longer than the janitor takes to confirm a reply-less release, so a key
#: is never freed by its own expiry before the release's outcome is seen.
RELEASE_TTL = 3.0
#: How long a reply is held back by ``slow-reply``: past NODE_TIMEOUT.
SLOW = 0.5
#: How long a waiter waits.
WAIT = 2.5
#: After the fault is healed, every key of the cell is gone within this.
CLEAN_WITHIN = 4.0

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


def cell_ids() -> list[str]:
    return [f"{op}-{fault}-{topo}" for op in OPERATIONS for fault in FAULTS for topo in TOPOLOGIES]


def documented() -> dict[str, str]:
    """The matrix table in docs/reliability.md: cell id -> expected outcome."""
    text = DOC.read_text()
    start = text.index("<!-- fault-matrix -->")
    end = text.index("<!-- /fault-matrix -->")
    table: dict[str, str] = {}
    for line in text[start:end].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 + len(FAULTS) or not cells[0].startswith("`"):
            continue
        op = cells[0].strip("`")
        topo = {"single Redis": "single", "Redlock (3)": "redlock3"}[cells[1]]
        for fault, outcome in zip(FAULTS, cells[2:], strict=True):
            table[f"{op}-{fault}-{topo}"] = re.sub(r"[*_`]", "", outcome)
    return table


def test_the_docs_table_has_exactly_the_suites_cells() -> None:
    table = documented()
    assert sorted(table) == sorted(cell_ids())
    assert set(table.values()) <= set(OUTCOMES), set(table.values()) - set(OUTCOMES)


# -- the set-up ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def aof_servers() -> Iterator[list[RedisServer]]:
    started: list[RedisServer] = []
    try:
        for _ in range(3):  # each started before the next picks a free port
            started.append(RedisServer(appendonly=True))
            started[-1].start()
        yield started
    finally:
        for server in started:
            server.close()


@dataclass
class Env:
    """One cell's world: the faulty node behind a proxy, and the lock manager."""

    topology: str
    servers: list[RedisServer]  # servers[0] is the faulty one
    proxy: FaultProxy
    manager: LockManager
    key: str
    warnings: list[str] = field(default_factory=list)
    paused_at: float | None = None
    ttl: float = TTL  # the cell's lease ttl: a paused node resumes after it

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def present(self) -> list[bool]:
        """Whether each node holds the cell's key now."""
        out = []
        for server in self.servers:
            if server.paused or not server.running:
                out.append(True)  # cannot tell: count it as held
                continue
            out.append(bool(client(server.url).exists(f"dlock:{{{self.key}}}")))
        return out

    def free(self) -> bool:
        """The key is free on a majority: a release did its job."""
        return sum(not held for held in self.present()) >= len(self.servers) // 2 + 1


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


@pytest.fixture(params=TOPOLOGIES)
def env(request: pytest.FixtureRequest, aof_servers: list[RedisServer]) -> Iterator[Env]:
    servers = aof_servers[:1] if request.param == "single" else aof_servers
    for server in servers:
        client(server.url).flushall()
    with FaultProxy(servers[0].port) as proxy:
        app = Celery("matrix", set_as_current=False)
        app.conf.dlock_urls = [proxy.url, *(s.url for s in servers[1:])]
        app.conf.dlock_node_timeout = NODE_TIMEOUT
        name = request.node.callspec.id.replace("[", "-").replace("]", "")
        cell = Env(request.param, servers, proxy, manager_for(app), f"m:{name}")
        handler = _Collect(cell.warnings)
        logging.getLogger("celery_dlock").addHandler(handler)
        try:
            yield cell
        finally:
            logging.getLogger("celery_dlock").removeHandler(handler)
            _heal(cell)


# -- faults ------------------------------------------------------------------------------------


def _before(env: Env, fault: str) -> None:
    """Apply ``fault`` to the faulty node, on connections made earlier and now idle."""
    server, proxy = env.servers[0], env.proxy
    raw = client(server.url)
    existing = proxy.open_pairs()
    if fault == "idle-timeout":
        # Blocked clients (a waiter's BLPOP) are exempt from the idle timeout.
        blocked = {c["addr"] for c in raw.client_list() if "b" in c["flags"]}
        idle = [p for p in existing if _addr(p.up) not in blocked]
        raw.config_set("timeout", 1)
        try:
            proxy.wait_closed(idle, 5.0)
        finally:
            idle_timeout(server.url, 0)
    elif fault == "client-kill":
        # Only the proxy's connections: the test's own client is not through the proxy.
        for pair in existing:
            raw.execute_command("CLIENT", "KILL", "ADDR", _addr(pair.up))
        proxy.wait_closed(existing, 5.0)
    elif fault == "reset-mid-reply":
        proxy.reset_mid_reply()
    elif fault == "blackhole":
        proxy.blackhole()
    elif fault == "slow-reply":
        proxy.delay(SLOW)
    elif fault in ("restart-empty", "restart-aof"):
        server.restart(wipe=fault == "restart-empty")
        proxy.wait_closed(existing, 5.0)
    elif fault == "paused-past-ttl":
        server.pause()
        env.paused_at = time.monotonic()
    else:  # pragma: no cover
        raise AssertionError(fault)


def _addr(sock: Any) -> str:
    host, port = sock.getsockname()
    return f"{host}:{port}"


def _heal(env: Env) -> None:
    """End the fault: a paused node resumes only once the cell's ttl has passed."""
    server = env.servers[0]
    if env.paused_at is not None:
        left = env.paused_at + env.ttl + 0.2 - time.monotonic()
        if left > 0:
            time.sleep(left)  # the fault is a pause longer than the ttl
        env.paused_at = None
    if server.paused:
        server.resume()
    env.proxy.heal()


def _clean(env: Env) -> None:
    """After the heal, no copy of the cell's key is left on any node."""
    deadline = time.monotonic() + CLEAN_WITHIN
    while any(env.present()):
        assert time.monotonic() < deadline, f"{env.key} left behind: {env.present()}"
        time.sleep(0.02)


def _within(begun: float, bound: float, what: str) -> None:
    took = time.monotonic() - begun
    assert took < bound + SLACK, f"{what} took {took:.2f} s; bound {bound:g} s"


# -- operations: each returns its outcome --------------------------------------------------------


def op_acquire(env: Env, fault: str) -> str:
    env.manager.acquire("warm", ttl=TTL, renew=False).release()
    _before(env, fault)
    begun = time.monotonic()
    try:
        lease = env.manager.acquire(env.key, ttl=TTL, renew=False)
    except LockUnavailable:
        _within(begun, NODE_TIMEOUT, "acquire")
        return "unavailable"
    _within(begun, NODE_TIMEOUT, "acquire")
    assert lease.valid_for > 0
    _heal(env)
    lease.release()
    return "done"


def op_renew(env: Env, fault: str) -> str:
    lost = threading.Event()
    errors: list[LockLost] = []

    def on_lost(lease: Lease, error: LockLost) -> None:
        errors.append(error)
        lost.set()

    guard = lock(
        env_app(env), env.key, ttl=RENEW_TTL, renew_interval=RENEW_INTERVAL, on_lost=on_lost
    )
    env.ttl = RENEW_TTL
    lease = guard.acquire()
    try:
        _before(env, fault)
        begun = time.monotonic()
        renewals = lease.renewals
        # Done: two renewals since the fault. Lost: reported by the validity's end.
        bound = lease.deadline - begun
        deadline = begun + max(bound, 2 * RENEW_INTERVAL) + SLACK
        while lease.renewals < renewals + 2 and not lost.is_set():
            assert time.monotonic() < deadline, "neither renewed nor reported lost"
            time.sleep(0.02)
        if lost.is_set():
            _within(begun, bound, "the loss report")
            return "lost"
        assert not lease.lost
        return "done"
    finally:
        _heal(env)
        lease.release()


def env_app(env: Env) -> Celery:
    app = Celery("matrix", set_as_current=False)
    app.conf.dlock_urls = [node.url for node in env.manager.nodes]
    app.conf.dlock_node_timeout = NODE_TIMEOUT
    return app


def _release(env: Env, fault: str, *, wait: bool) -> str:
    env.ttl = RELEASE_TTL
    env.manager.acquire("warm", ttl=TTL, renew=False).release(wait=wait)  # scripts cached
    lease = env.manager.acquire(env.key, ttl=RELEASE_TTL, renew=False)
    if fault == "reset-mid-reply" and not wait:
        # A reply-less release has no reply to cut: its connection is reset as it arrives
        # (the proxy drops it and closes), the race a zero-timeout poll cannot see.
        env.proxy.swallow()
    else:
        _before(env, fault)
    begun = time.monotonic()
    lease.release(wait=wait)
    # Waited: returns within one node timeout. Reply-less: returns at once; what it could not
    # confirm the janitor sends again within CONFIRM_GRACE + SWEEP_TICK, plus a node timeout.
    bound = NODE_TIMEOUT if wait else CONFIRM_GRACE + SWEEP_TICK + NODE_TIMEOUT
    _within(begun, NODE_TIMEOUT, "release")
    # Done: the key is free on a majority within the bound (the janitor may have helped).
    # Logged: it is not, and a warning names the key.
    deadline = begun + bound + SLACK
    while time.monotonic() < deadline:
        if env.free():
            return "done"
        time.sleep(0.02)
    assert any("release of" in w and env.key in w for w in env.warnings), (
        f"release neither freed the key nor was reported: {env.present()}"
    )
    return "logged"


def op_release_waited(env: Env, fault: str) -> str:
    return _release(env, fault, wait=True)


def op_release_replyless(env: Env, fault: str) -> str:
    return _release(env, fault, wait=False)


def op_blocking_pop(env: Env, fault: str) -> str:
    app = env_app(env)
    holder = lock(app, env.key, ttl=30).acquire()
    outcome: list[str] = []
    blocked = threading.Event()

    def waiter() -> None:
        blocked.set()
        try:
            with lock(app, env.key, ttl=5, wait=WAIT):
                outcome.append("done")
        except LockContended:
            outcome.append("contended")
        except LockUnavailable:
            outcome.append("unavailable")

    thread = threading.Thread(target=waiter)
    begun = time.monotonic()
    thread.start()
    blocked.wait(5)
    time.sleep(0.3)  # let the waiter block in BLPOP (pacing: the outcomes do not depend on it)
    _before(env, fault)
    holder.release(wait=False)
    thread.join(WAIT + NODE_TIMEOUT + SLACK + 2)
    assert outcome, "the waiter neither got the lock nor gave up"
    _within(begun, WAIT + NODE_TIMEOUT + 0.3, "the wait")
    return outcome[0]


def _held(env: Env) -> Lease:
    return env.manager.acquire(env.key, ttl=30, renew=False)


def _read(env: Env, fault: str, read: Callable[[], Any]) -> str:
    lease = _held(env)
    try:
        _before(env, fault)
        begun = time.monotonic()
        try:
            result = read()
        except LockUnavailable:
            # The listing's SCAN waits up to max(node timeout, 1 s).
            _within(begun, 1.0 + NODE_TIMEOUT, "the read")
            return "unavailable"
        _within(begun, 1.0 + NODE_TIMEOUT, "the read")
        # The truth: held by the lease, unless a majority lost the key (an empty restart).
        truth = None if env.free() else lease.token
        assert result == truth, f"read {result!r}; the truth is {truth}"
        return "done"
    finally:
        _heal(env)
        lease.release()


def op_cli_holder(env: Env, fault: str) -> str:
    def read() -> Any:
        holder = env.manager.holder(env.key)
        return holder.fence if holder else None

    return _read(env, fault, read)


def op_cli_inspect(env: Env, fault: str) -> str:
    def read() -> Any:
        info = env.manager.inspect(env.key)
        return info.holder.fence if info.holder else None

    return _read(env, fault, read)


def op_cli_locks(env: Env, fault: str) -> str:
    def read() -> Any:
        found = [i for i in env.manager.locks("m:") if i.key == env.key]
        return found[0].holder.fence if found and found[0].holder else None

    return _read(env, fault, read)


OPS: dict[str, Callable[[Env, str], str]] = {
    "acquire": op_acquire,
    "renew": op_renew,
    "release-waited": op_release_waited,
    "release-replyless": op_release_replyless,
    "blocking-pop": op_blocking_pop,
    "cli-holder": op_cli_holder,
    "cli-inspect": op_cli_inspect,
    "cli-locks": op_cli_locks,
}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("op", OPERATIONS)
def test_cell(env: Env, op: str, fault: str) -> None:
    cell = f"{op}-{fault}-{env.topology}"
    outcome = OPS[op](env, fault)
    _heal(env)
    _clean(env)
    record = os.environ.get("DLOCK_MATRIX_RECORD")
    if record:  # to write the docs table from a run: one "cell outcome" line per cell
        with open(record, "a") as out:
            out.write(f"{cell} {outcome}\n")
        return
    expected = documented()[cell]
    assert outcome == expected, f"{op} under {fault} on {env.topology}: {outcome}"
