"""The exit-path matrix: every way a body ends or a message is delivered, on real workers.

Each row runs ``tests.worker_app.seam`` (or a sibling) on the pools where the row applies, and
checks from the journal the same three things:

* **no overlap**: no two bodies of the row's key ever ran at once; a duplicate sent while the
  body runs (to a separate prefork "probe" worker) is dropped, naming the holder;
* **the key frees promptly**: within :data:`PROMPT` seconds of the body's true end for a clean
  end, within the lease's ttl when nothing could release it (the worker killed outright); then
  a fresh execution takes it;
* **the caller sees** the state and result docs/guarantees.md promises for the row.

docs/guarantees.md carries the matrix as a table; :func:`test_the_table_and_the_matrix_agree`
keeps the two the same. Workers are shared per pool (module scope); only rows that stop or kill
their worker, or need other settings, start their own.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from celery import VERSION, states
from celery.exceptions import (
    MaxRetriesExceededError,
    Reject,
    SoftTimeLimitExceeded,
    TimeLimitExceeded,
)

from celery_dlock import Holder, LockLost
from celery_dlock.core.holder import parse_value
from tests.support.celery_fixtures import Mode, make_mode
from tests.support.clients import client
from tests.support.workers import Journal, Worker, intervals, overlaps

pytestmark = [pytest.mark.slow, pytest.mark.local_redis]

CELERY_VERSION = (VERSION.major, VERSION.minor)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "guarantees.md"
#: The seam tasks' lease length (tests/support/worker_app.py): the bound for a key nobody can
#: release.
TTL = 2.0
#: "At once", allowing for a loaded test machine.
PROMPT = 1.0
POOLS = ("prefork", "threads", "solo")
ALL = POOLS
PREFORK = ("prefork",)
LATE_ENV = {
    "DLOCK_TEST_ACKS_LATE": "1",
    "DLOCK_TEST_VISIBILITY": "3",
    "DLOCK_TEST_RESTORE_EVERY": "0.5",
}


@dataclass
class Run:
    """One row on one pool, under way."""

    wa: Any
    journal: Journal
    worker: Worker
    mode: Mode
    name: str
    task: str  # the task's full name
    result: Any = None
    killed_at: float | None = None  # when the test killed the body outright (no "end")

    @property
    def key(self) -> str:
        return f"seam:{self.name}"


@dataclass(frozen=True)
class Row:
    """One way a body ends or a message is delivered."""

    id: str
    pools: tuple[str, ...]
    caller: Callable[[Run], None]  # asserts what the caller sees
    how: str = "return"
    secs: float = 1.5
    task: str = "seam"
    options: dict[str, Any] = field(default_factory=dict)
    #: What the test does once the body runs (revoke it, delete its key, stop its worker...).
    act: Callable[[Run], None] | None = None
    #: Executions of the body that record an "end" (retries and requeues run it again).
    ends: int = 1
    #: The journal event that says the body is in its protected part (sent the probe then).
    running: str = "start"
    #: What the test waits for once the caller has its answer (a redelivered copy's end).
    after: Callable[[Run], None] | None = None
    #: The body never runs: the message is discarded before (then ``act`` does the rest).
    never_runs: bool = False
    #: Nothing can release the key (the worker was killed): it frees within the ttl.
    crash: bool = False
    #: A worker of the row's own: "warm"/"cold"/"kill" stop it; "late" and "remap" are
    #: settings (acks_late with a short visibility timeout; REMAP_SIGTERM).
    worker: str = "shared"
    #: Also run with RabbitMQ as the broker (every row runs with Redis): the rows where the
    #: broker takes part (a broker requeue with late acks, revoke, enqueue-time locks).
    rabbitmq: bool = False


# -- what the caller sees ------------------------------------------------------------------------


def meta_of(wa: Any, task_id: str) -> dict[str, Any]:
    """The result backend's record now, read afresh: a final state can change here (REVOKED
    turns SUCCESS when the body a revoke did not stop finishes), which Celery's own result
    objects, caching the first final state they saw, would not show."""
    meta: dict[str, Any] = wa.app.backend.get_task_meta(task_id, cache=False)
    return meta


def state_of(wa: Any, task_id: str) -> str:
    return str(meta_of(wa, task_id)["status"])


def settles(run: Run, wanted: str, timeout: float = 20) -> Any:
    """Wait for the caller's state to be ``wanted``; the result (or error) stored with it."""
    deadline = time.monotonic() + timeout
    while (found := meta_of(run.wa, run.result.id))["status"] != wanted:
        assert time.monotonic() < deadline, f"{run.result.id} is {found['status']}, not {wanted}"
        time.sleep(0.02)
    return found["result"]


def succeeds_with(value: str | None = None) -> Callable[[Run], None]:
    def check(run: Run) -> None:
        assert settles(run, states.SUCCESS) == (value or run.name)

    return check


def fails_with(error: type[BaseException]) -> Callable[[Run], None]:
    def check(run: Run) -> None:
        assert isinstance(settles(run, states.FAILURE), error)

    return check


def revoked(run: Run) -> None:
    settles(run, states.REVOKED)


def revoked_or_fails_with(error: type[BaseException]) -> Callable[[Run], None]:
    """A revoke whose signal raises ``error`` in the body: two processes store a state. The
    worker's parent stores REVOKED just after sending the signal, the pool process FAILURE
    with ``error`` once the body has raised it, and the result backend keeps the last write
    (only SUCCESS is never overwritten). Usually the parent writes first, but a parent slowed
    down after its kill() lets the child write first: the caller then sees REVOKED for good.
    Both are Celery's answer for this ending; the body must have been stopped by ``error``."""

    def check(run: Run) -> None:
        # Each is recorded after its store: once both are there, the state is final.
        run.journal.wait_for("revoked", id=run.result.id, timeout=20)
        (failed,) = run.journal.wait_for("failed", id=run.result.id, timeout=20)
        assert failed["error"] == error.__name__, failed
        meta = meta_of(run.wa, run.result.id)
        assert meta["status"] in (states.REVOKED, states.FAILURE), meta
        if meta["status"] == states.FAILURE:
            assert isinstance(meta["result"], error), meta

    return check


def stays_pending(run: Run) -> None:
    # Celery stores nothing for this ending: the caller's result stays PENDING for ever.
    assert state_of(run.wa, run.result.id) == states.PENDING


def revoked_then_succeeds(run: Run) -> None:
    # The parent marks it REVOKED at once; the body, which the signal did not stop, then
    # finishes and its result replaces that.
    succeeds_with()(run)


def cancelled(run: Run) -> None:
    # Celery 5.5+ cancels the running task on a cold shutdown and records RETRY, although
    # with early acks no retry comes: the message is gone.
    if CELERY_VERSION >= (5, 5):
        settles(run, states.RETRY)


def rejected(run: Run) -> None:
    if CELERY_VERSION >= (5, 7):
        fails_with(Reject)(run)  # Celery 5.7 records a rejected task as failed
    else:
        stays_pending(run)


# -- what the test does while the body runs ------------------------------------------------------


def revoke_with(name: str) -> Callable[[Run], None]:
    def act(run: Run) -> None:
        if name == "SIGKILL":
            run.killed_at = time.monotonic()
        run.wa.app.control.revoke(run.result.id, terminate=True, signal=name)

    return act


def revoke_queued(run: Run) -> None:
    # Received (held by the worker until its countdown), then revoked before it runs.
    task = f"{run.task}[{run.result.id}]"
    wait_log(run.worker, f"Task {task} received")
    run.wa.app.control.revoke(run.result.id)
    wait_log(run.worker, f"Discarding revoked task: {task}")


def revoke_queued_enqueued(run: Run) -> None:
    # Enqueue-time mode: the queued message holds the key; a duplicate merges into it.
    assert run.wa.seam_enqueued.apply_async((run.name,), queue=run.worker.queue).id == (
        run.result.id
    )
    revoke_queued(run)


def delete_key(run: Run) -> None:
    for url in run.mode.lock_urls:
        client(url).delete(f"dlock:{{{run.key}}}")


def warm_shutdown(run: Run) -> None:
    run.worker.stop()  # SIGTERM: the worker lets the running task finish


def cold_shutdown(run: Run) -> None:
    assert run.worker.process is not None
    os.kill(run.worker.process.pid, signal.SIGQUIT)
    run.worker.process.wait(timeout=20)
    run.worker.stop()


def kill_worker(run: Run) -> None:
    run.killed_at = time.monotonic()
    run.worker.kill()


def discarded_copy(expired: bool) -> Callable[[Run], None]:
    def act(run: Run) -> None:
        if not expired:
            run.wa.app.control.revoke(run.result.id)  # no terminate: the running one goes on
        wait_log(run.worker, f"Discarding revoked task: tests.worker_app.seam[{run.result.id}]")
        # The copy discarded, the key is still the running body's: a duplicate is dropped.
        value = run.wa.seam_probe.apply_async((run.name,), queue="xp_probe").get(timeout=15)
        assert isinstance(value, dict), f"a duplicate ran beside {run.result.id}: {value!r}"
        assert value["holder"] == run.result.id

    return act


def redelivered(run: Run) -> None:
    # The copy comes back while the first runs, finds the key held, and waits.
    run.journal.wait_for("contended", id=run.result.id, policy="requeue", timeout=15)


def copy_skipped(run: Run) -> None:
    # Once the first has finished, the copy ends without running (its result is there).
    run.journal.wait_for("contended", id=run.result.id, policy="drop", timeout=15)


def wait_log(worker: Worker, text: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while text not in worker.log():
        assert time.monotonic() < deadline, f"no {text!r} in {worker.name}'s log"
        time.sleep(0.02)


# -- the matrix --------------------------------------------------------------------------------

ROWS = [
    Row("return", ALL, succeeds_with(), rabbitmq=True),
    Row("exception", ALL, fails_with(ValueError), how="raise"),
    Row("retry", ALL, succeeds_with(), how="retry", ends=2),
    Row(
        "retries-exhausted-fallback",
        ALL,
        succeeds_with("fallback"),
        how="exhausted_fallback",
        running="fallback",
    ),
    Row("retries-exhausted-raise", ALL, fails_with(MaxRetriesExceededError), how="exhausted_raise"),
    Row("ignore", ALL, stays_pending, how="ignore"),
    Row(
        "reject-requeue",
        ALL,
        succeeds_with(),
        how="reject_requeue",
        task="seam_late",
        ends=2,
        rabbitmq=True,
    ),
    Row("reject", ALL, rejected, how="reject"),
    Row("lock-lost", ALL, fails_with(LockLost), secs=10, act=delete_key),
    Row(
        "soft-time-limit",
        PREFORK,
        fails_with(SoftTimeLimitExceeded),
        secs=10,
        options={"soft_time_limit": 1.5},
    ),
    Row(
        "hard-time-limit",
        PREFORK,
        fails_with(TimeLimitExceeded),
        secs=10,
        options={"time_limit": 1.5},
    ),
    Row("revoke-SIGTERM", PREFORK, revoked, secs=10, act=revoke_with("SIGTERM"), rabbitmq=True),
    Row("revoke-SIGINT", PREFORK, revoked_then_succeeds, secs=2.5, act=revoke_with("SIGINT")),
    Row("revoke-SIGQUIT", PREFORK, revoked, secs=10, act=revoke_with("SIGQUIT")),
    Row(
        "revoke-SIGUSR1",
        PREFORK,
        revoked_or_fails_with(SoftTimeLimitExceeded),
        secs=10,
        act=revoke_with("SIGUSR1"),
    ),
    Row(
        "revoke-SIGKILL",
        PREFORK,
        revoked,
        secs=10,
        act=revoke_with("SIGKILL"),
        ends=0,
        rabbitmq=True,
    ),
    Row(
        "revoke-SIGTERM-remapped",
        PREFORK,
        revoked_then_succeeds,
        secs=2.5,
        act=revoke_with("SIGTERM"),
        worker="remap",
    ),
    Row(
        "countdown-revoked",
        ALL,
        revoked,
        options={"countdown": 3},
        act=revoke_queued,
        never_runs=True,
        ends=0,
        rabbitmq=True,
    ),
    Row(
        "countdown-revoked-enqueued",
        ALL,
        revoked,
        task="seam_enqueued",
        options={"countdown": 3},
        act=revoke_queued_enqueued,
        never_runs=True,
        ends=0,
        rabbitmq=True,
    ),
    Row("warm-shutdown", ALL, succeeds_with(), act=warm_shutdown, worker="warm"),
    Row("cold-shutdown", PREFORK, cancelled, secs=10, act=cold_shutdown, worker="cold"),
    Row(
        "worker-SIGKILL",
        PREFORK,
        stays_pending,
        secs=10,
        act=kill_worker,
        ends=0,
        crash=True,
        worker="kill",
    ),
    Row(
        "acks-late-redelivery",
        PREFORK,
        succeeds_with(),
        secs=5,
        act=redelivered,
        after=copy_skipped,
        worker="late",
    ),
    Row(
        "expired-copy-discarded",
        PREFORK,
        succeeds_with(),
        secs=5,
        options={"expires": 2.5},
        act=discarded_copy(expired=True),
        worker="late",
    ),
    Row(
        "revoked-copy-discarded",
        PREFORK,
        succeeds_with(),
        secs=5,
        act=discarded_copy(expired=False),
        worker="late",
    ),
]

CASES = [pytest.param(row, pool, id=f"{row.id}-{pool}") for row in ROWS for pool in row.pools]
#: The brokers the rows run with: Redis for every row, RabbitMQ for those marked ``rabbitmq``.
#: A parameter of its own (module-scoped, so each broker's workers start once), its combinations
#: with rows not marked dropped at collection (tests/conftest.py reads ``KEEP``).
BROKERS = ("redis", "rabbitmq")


def KEEP(params: dict[str, Any]) -> bool:  # a module hook, named like MODES
    row = params.get("row")
    return params.get("broker") != "rabbitmq" or (isinstance(row, Row) and row.rabbitmq)


def case_ids() -> set[str]:
    """``<row id>-<pool>-<broker>`` of every case the matrix runs."""
    return {
        f"{row.id}-{pool}-{broker}"
        for row in ROWS
        for pool in row.pools
        for broker in BROKERS
        if KEEP({"row": row, "broker": broker})
    }


# -- workers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broker(request: pytest.FixtureRequest, celery_base: str) -> str:
    """The broker URL of the module's workers: Redis, or this session's RabbitMQ (the
    ``rabbitmq_url`` fixture, which skips with one line where there is no RabbitMQ)."""
    if request.param == "rabbitmq":
        url: str = request.getfixturevalue("rabbitmq_url")
        return url
    return make_mode("single", celery_base).env["DLOCK_TEST_BROKER"]


@pytest.fixture(scope="module")
def mode(celery_base: str, broker: str) -> Mode:
    """About Celery's side: one Redis for the locks is enough; the broker is a parameter."""
    found = make_mode("single", celery_base)
    found.env["DLOCK_TEST_BROKER"] = broker
    return found


class Workers:
    """The module's workers: one per pool (and per special setting), started when first
    needed; the probe worker takes the duplicates and the followers."""

    def __init__(self, mode: Mode, journal: Journal) -> None:
        self.mode = mode
        self.journal = journal
        self.shared: dict[str, Worker] = {}
        self.own: list[Worker] = []

    def start(self, name: str, pool: str, env: dict[str, str] | None = None) -> Worker:
        concurrency = 1 if pool == "solo" else 3
        worker = Worker(
            {**self.mode.env, **(env or {})},
            self.journal,
            name=name,
            pool=pool,
            concurrency=concurrency,
            queue=f"xp_{name}",
        )
        return worker.start()

    def get(self, kind: str, pool: str) -> Worker:
        if kind in ("warm", "cold", "kill"):  # stopped by the row: a fresh one each time
            worker = self.start(f"{kind}-{pool}-{len(self.own)}", pool)
            self.own.append(worker)
            return worker
        env = {"late": LATE_ENV, "remap": {"REMAP_SIGTERM": "SIGQUIT"}}.get(kind)
        name = pool if kind == "shared" else f"{kind}-{pool}"
        if name not in self.shared:
            self.shared[name] = self.start(name, pool, env)
        return self.shared[name]

    def stop(self) -> None:
        for worker in [*self.shared.values(), *self.own]:
            worker.stop()


@pytest.fixture(scope="module")
def workers(mode: Mode, wa: Any) -> Iterator[Workers]:
    found = Workers(mode, Journal(mode.env["DLOCK_TEST_JOURNAL"]))
    found.shared["probe"] = found.start("probe", "prefork")
    yield found
    found.stop()


# -- the suite ---------------------------------------------------------------------------------


@pytest.fixture
def watches() -> Iterator[Callable[[str, str], KeyWatch]]:
    started: list[KeyWatch] = []

    def watch(url: str, key: str) -> KeyWatch:
        started.append(KeyWatch(url, key))
        return started[-1]

    yield watch
    for watch_ in started:
        watch_.stop()


@pytest.mark.parametrize("broker", BROKERS, indirect=True)
@pytest.mark.parametrize(("row", "pool"), CASES)
def test_exit_path(
    row: Row,
    pool: str,
    broker: str,
    wa: Any,
    journal: Journal,
    workers: Workers,
    watches: Callable[[str, str], KeyWatch],
) -> None:
    worker = workers.get(row.worker, pool)
    task = getattr(wa, row.task)
    run = Run(wa, journal, worker, workers.mode, name=f"{row.id}-{pool}", task=task.name)
    watch = watches(workers.mode.lock_urls[0], run.key)
    run.result = task.apply_async((run.name, row.how, row.secs), queue=worker.queue, **row.options)
    if not row.never_runs:
        journal.wait_for(row.running, id=run.result.id, timeout=20)
        # Exclusion while it runs: a duplicate elsewhere is dropped, naming this execution.
        value = wa.seam_probe.apply_async((run.name,), queue="xp_probe").get(timeout=15)
        assert isinstance(value, dict), f"a duplicate ran beside {run.result.id}: {value!r}"
        assert value["holder"] == run.result.id
    if row.act is not None:
        row.act(run)
    acted = time.monotonic()
    row.caller(run)
    if row.after is not None:
        row.after(run)
    ended = journal.wait_for("end", id=run.result.id, count=row.ends) if row.ends else []
    assert len(ended) == row.ends, ended
    starts = journal.select("start", id=run.result.id)
    if row.never_runs:
        assert starts == []
        body_end = acted  # it never ran: its queued lock (if any) goes with the discard
        mine: Callable[[Holder], bool] = lambda h: h.holder == run.result.id  # noqa: E731
    else:
        body_end = run.killed_at if row.ends == 0 else max(e["t"] for e in ended)
        fences = {s["token"] for s in starts}
        mine = lambda h: h.fence in fences  # noqa: E731
    # The key frees promptly after the body truly ended (within the ttl after a crash) ...
    seen_free = wait_free(wa, run.key, timeout=TTL + 5)
    assert watch.ever(mine) or (row.task == "seam" and row.never_runs), "never seen held"
    freed = watch.freed_after(mine, seen_free)
    assert freed is not None
    assert freed - body_end < (TTL + PROMPT if row.crash else PROMPT), freed - body_end
    # ... for real: a fresh execution takes it.
    assert wa.seam_probe.apply_async((run.name,), queue="xp_probe").get(timeout=15) == run.name
    spans = intervals(journal.entries(), name=run.name)
    for start in journal.select("start", id=run.result.id):
        if not any(e["t"] > start["t"] for e in journal.select("end", id=run.result.id)):
            spans.append((start["t"], run.killed_at or time.monotonic(), run.result.id))
    assert overlaps(sorted(spans)) == [], spans


class KeyWatch:
    """Samples who holds a key every few milliseconds, from a thread, so the time the key
    freed is known however long the test itself is busy (a worker's shutdown, say)."""

    def __init__(self, url: str, key: str) -> None:
        self.redis_key = f"dlock:{{{key}}}"
        self.client = client(url)
        # (sent, answered, holder): a GET sent before the key freed can be answered after the
        # test saw it free, so "a sample after seen_free" must go by the time it was sent.
        self.samples: list[tuple[float, float, Holder | None]] = []
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            sent = time.monotonic()
            raw = self.client.get(self.redis_key)
            self.samples.append((sent, time.monotonic(), parse_value(raw)))
            time.sleep(0.002)

    def ever(self, mine: Callable[[Holder], bool]) -> bool:
        return any(h is not None and mine(h) for _, _, h in list(self.samples))

    def freed_after(self, mine: Callable[[Holder], bool], seen_free: float) -> float | None:
        """The first moment the key was seen not held by ``mine`` after it last was; waits
        for a sample sent after ``seen_free`` (when the test saw the key free itself)."""
        deadline = time.monotonic() + 5
        while not self.samples or self.samples[-1][0] <= seen_free:
            assert time.monotonic() < deadline, "the key watch stopped sampling"
            time.sleep(0.002)
        samples = list(self.samples)
        held = [i for i, (_, _, h) in enumerate(samples) if h is not None and mine(h)]
        last = held[-1] if held else -1
        following = samples[last + 1 :]
        return following[0][1] if following else None

    def stop(self) -> None:
        self.running = False
        self.thread.join()


def wait_free(wa: Any, key: str, timeout: float) -> float:
    manager = wa.seam._dlock().manager
    deadline = time.monotonic() + timeout
    while manager.holder(key) is not None:
        assert time.monotonic() < deadline, f"{key!r} still held after {timeout} s"
        time.sleep(0.005)
    return time.monotonic()


# -- the table in docs/guarantees.md -----------------------------------------------------------

TABLE_ROW = re.compile(r"^\| `(?P<id>[^`]+)`[^|]*\|(?P<cells>.*)\|\s*$")


def documented() -> set[str]:
    """``<row id>-<pool>-redis`` for every pool the exit-path table in docs/guarantees.md
    marks, and ``<row id>-<pool>-rabbitmq`` for those of a row its RabbitMQ column marks."""
    section = DOCS.read_text().split("## Exit paths", 1)[1].split("\n## ", 1)[0]
    found = set()
    for line in section.splitlines():
        match = TABLE_ROW.match(line)
        if match is None:
            continue
        cells = [c.strip() for c in match.group("cells").split("|")][: len(POOLS) + 1]
        marked = [pool for pool, cell in zip(POOLS, cells, strict=False) if cell == "yes"]
        brokers = ("redis", "rabbitmq") if cells[len(POOLS)] == "yes" else ("redis",)
        found |= {f"{match.group('id')}-{pool}-{broker}" for pool in marked for broker in brokers}
    return found


def test_the_table_and_the_matrix_agree() -> None:
    assert documented() == case_ids()
