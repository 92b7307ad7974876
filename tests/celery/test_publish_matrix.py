"""The publish-shape matrix: every way a task is published, on real workers.

Each row publishes ``tests.worker_app.seam`` (``lock_on="execute"``) or ``seam_enqueued``
(``lock_on="enqueue"``), both keyed ``seam:{name}``, in one of Celery's publishing shapes, on
each lock store where the row applies, and checks from the journal the same four things:

* **one body at a time**: no two bodies of the row's key ever ran at once;
* **every caller gets an answer**: each result and canvas a publish gave back becomes ready
  within the bodies' run time plus :data:`SLACK` seconds;
* **nothing merged into the dead**: each answer is the body's own value, or the documented
  drop result naming a task that really ran;
* **the key frees**: within :data:`PROMPT` seconds after the last body's end, and exactly the
  row's number of bodies ran.

docs/singleton.md carries the matrix as a table (section "Publish shapes");
:func:`test_the_table_and_the_matrix_agree` keeps the two the same. One prefork worker per lock
store serves the whole module. The broker is the ``broker_url`` parameter: a Redis database for
every row, and this session's RabbitMQ for the enqueue-time rows on a single Redis
(:data:`BROKERS`, :func:`KEEP`), whose every publish, purge, expiry and revoke goes through
the broker.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import chain, chord, group

from celery_dlock.ops import admin
from tests.support.celery_fixtures import Mode, make_mode, with_db
from tests.support.workers import Journal, Worker

pytestmark = [pytest.mark.slow]

MODES = ("single", "redlock5", "zookeeper")
ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "singleton.md"
#: The task of each kind (tests/support/worker_app.py): ``SingletonTask`` with each ``lock_on``, and
#: the drop-in classes (both lock at enqueue), each under a subclass that opts calls out.
TASKS = {
    "execute": "seam",
    "enqueue": "seam_enqueued",
    "singleton": "seam_singleton",
    "once": "seam_once",
}
LOCK_ONS = ("execute", "enqueue")
COMPAT = ("singleton", "once")
#: The lock stores each kind runs on. Only the enqueue-time path takes the key at publish, so
#: only it runs on every store; execution-time mode takes nothing until a worker runs the body
#: (that lock is tested on every store in tests/celery/test_singleton.py), and the drop-in classes
#: share the enqueue-time path: one store is enough for them.
KIND_MODES = {
    "execute": ("single",),
    "enqueue": MODES,
    "singleton": ("single",),
    "once": ("single",),
}
#: The docs table's columns, in order.
COLUMNS = [(kind, m) for kind in TASKS for m in KIND_MODES[kind]]
#: Seconds a caller may wait beyond the bodies' own run time (a requeue's backoff, a loaded box).
SLACK = 6.0
#: "At once" after a body's end, allowing for a loaded test machine.
PROMPT = 1.0


@dataclass
class Run:
    """One row on one lock store and ``lock_on``, under way."""

    wa: Any
    journal: Journal
    mode: Mode
    name: str
    lock_on: str
    secs: float
    #: The task of each kind, where the row uses another than :data:`TASKS`'s.
    tasks: dict[str, str] = field(default_factory=dict)
    #: What a row's publish keeps for its ``after`` check.
    kept: dict[str, Any] = field(default_factory=dict)

    @property
    def task(self) -> Any:
        return getattr(self.wa, self.tasks.get(self.lock_on, TASKS[self.lock_on]))

    @property
    def key(self) -> str:
        return str(self.task.lock_key_for(self.args(), {}))

    def args(self, how: str = "return") -> tuple[Any, ...]:
        return (self.name, how, self.secs)


#: What a row's publish gives back: the results and canvases its callers wait on.
Publish = Callable[[Run], list[Any]]


@dataclass(frozen=True)
class Row:
    """One publishing shape."""

    id: str
    publish: Publish
    #: Bodies that run, per kind (a range where the worker's timing decides), default 1.
    runs: dict[str, int | tuple[int, int]] = field(default_factory=dict)
    #: The kinds of task the row applies to (see :data:`TASKS`).
    lock_on: tuple[str, ...] = LOCK_ONS
    modes: tuple[str, ...] = MODES
    secs: float = 1.0
    #: What the test waits for once the callers have their answers.
    after: Callable[[Run], None] | None = None
    #: The task of each kind, where not :data:`TASKS`'s.
    tasks: dict[str, str] = field(default_factory=dict)

    def bodies(self, kind: str) -> tuple[int, int]:
        runs = self.runs.get(kind, 1)
        return runs if isinstance(runs, tuple) else (runs, runs)


# -- the shapes ----------------------------------------------------------------------------------


def delay(run: Run) -> list[Any]:
    return [run.task.delay(*run.args())]


def republish_own(run: Run) -> list[Any]:
    # The body publishes its own task id again while it runs ("run me again" without retry()).
    first = run.task.apply_async(run.args("republish_own"))
    run.journal.wait_for("republished", id=first.id, timeout=20)
    return [first]


def reschedule(run: Run) -> list[Any]:
    # The body publishes its next run (a new id, the same key) with a countdown that ends
    # after the body does: the next run must happen, not be merged into the run in progress.
    first = run.task.apply_async(run.args("reschedule"))
    (event,) = run.journal.wait_for("rescheduled", id=first.id, timeout=20)
    return [first, run.task.AsyncResult(event["new"])]


def running_first(run: Run) -> Any:
    """A call of the row's key, seen running (the holder a duplicate meets)."""
    first = run.task.apply_async(run.args())
    run.journal.wait_for("start", id=first.id, timeout=20)
    return first


def group_of_duplicates(run: Run) -> list[Any]:
    return [group(run.task.s(*run.args()), run.task.s(*run.args())).apply_async()]


def chord_with_duplicate(run: Run) -> list[Any]:
    header = [run.task.s(*run.args()), run.task.s(*run.args())]
    return [chord(header, run.wa.gather.s()).apply_async()]


def chain_head_duplicate(run: Run) -> list[Any]:
    first = running_first(run)
    return [first, chain(run.task.s(*run.args()), run.wa.gather.s()).apply_async()]


def chain_tail_duplicate(run: Run) -> list[Any]:
    # The duplicate is a chain's last step, published by the worker once the step before it
    # ends: the chain's result is that step's own id.
    first = running_first(run)
    return [first, chain(run.wa.gather.si(1), run.task.si(*run.args())).apply_async()]


def link_of_duplicate(run: Run) -> list[Any]:
    first = running_first(run)
    return [first, run.task.apply_async(run.args(), link=run.wa.linked.s(run.name))]


def link_ran(run: Run) -> None:
    run.journal.wait_for("linked", name=run.name, timeout=SLACK)


def opted_out(run: Run) -> list[Any]:
    # super(Singleton, self).apply_async(...) / super(QueueOnce, self): Celery's own publish,
    # so three calls are three messages; the execution-time lock still keeps the bodies apart.
    results = [run.task.apply_async(run.args(), unlocked=True) for _ in range(3)]
    assert len({r.id for r in results}) == 3, [r.id for r in results]
    return results


def until(wall: float) -> None:
    """Wait until the wall clock reads ``wall`` (an eta or expiry is a wall-clock time)."""
    while time.time() < wall:
        time.sleep(min(0.02, max(0.0, wall - time.time())))


def duplicate(run: Run, **options: Any) -> Any:
    return run.task.apply_async(run.args(), **options)


def countdown(run: Run) -> list[Any]:
    return [duplicate(run, countdown=0.5)]


def eta_aware(run: Run) -> list[Any]:
    return [duplicate(run, eta=datetime.now(timezone.utc) + timedelta(seconds=0.5))]


def eta_naive(run: Run) -> list[Any]:
    # Celery takes a naive eta as UTC (enable_utc, the default).
    naive = datetime.now(timezone.utc).replace(tzinfo=None) + timedelta(seconds=0.5)
    return [duplicate(run, eta=naive)]


def eta_iso_string(run: Run) -> list[Any]:
    # An eta past the queued lock's own life (1 s, seam_enqueued_short): a duplicate
    # published after that life but before the eta must still merge, not run a second time.
    published = time.time()
    eta = datetime.now(timezone.utc) + timedelta(seconds=2.5)
    first = duplicate(run, eta=eta.isoformat())
    until(published + 1.5)
    second = duplicate(run)
    if run.lock_on == "enqueue":  # the first still waits for its eta: merged into it
        assert second.id == first.id, "a duplicate during the eta was not merged"
    return [first, second]


def expires_seconds(run: Run) -> list[Any]:
    return [duplicate(run, expires=60)]


def expires_datetime(run: Run) -> list[Any]:
    return [duplicate(run, expires=datetime.now(timezone.utc) + timedelta(seconds=60))]


def expires_passed(run: Run) -> list[Any]:
    # The first message expires (1 s) before the worker may run it (countdown 2 s), so the
    # worker discards it; a call published after it expired must run, not merge into it.
    published = time.time()
    run.kept["expired"] = duplicate(run, countdown=2.0, expires=1.0)
    until(published + 1.3)
    return [duplicate(run)]


def expires_passed_iso_string(run: Run) -> list[Any]:
    # As expires-passed, with ``expires`` an ISO 8601 string in a spelling Celery reads
    # (dateutil's isoparse, publisher and worker) but datetime.fromisoformat does not: a
    # lowercase "z" (RFC 3339); on Python 3.10 also "Z" and "+0900".
    published = time.time()
    at = datetime.now(timezone.utc) + timedelta(seconds=1.0)
    run.kept["expired"] = duplicate(
        run, countdown=2.0, expires=at.strftime("%Y-%m-%dT%H:%M:%S.%fz")
    )
    until(published + 1.3)
    return [duplicate(run)]


def expired_discarded(run: Run) -> None:
    expired = run.kept["expired"]
    run.journal.wait_for("revoked", id=expired.id, timeout=SLACK)
    assert run.journal.select("start", id=expired.id) == []


def merged_duplicate(run: Run) -> list[Any]:
    first = running_first(run)
    return [first, duplicate(run)]


def send_task_by_name(run: Run) -> list[Any]:
    first = running_first(run)
    return [first, run.wa.app.send_task(run.task.name, run.args())]


def signature_apply_async(run: Run) -> list[Any]:
    first = running_first(run)
    return [first, run.task.s(*run.args()).apply_async()]


def priority(run: Run) -> list[Any]:
    return [duplicate(run, priority=5)]


def purged_between(run: Run) -> list[Any]:
    # The first message waits in a queue no worker consumes, and `celery purge` removes it.
    # Its queued lock (enqueue) is left behind: the operator view shows it as queued, with
    # the task id it waits on, and the documented way out frees it; then a call runs.
    first = duplicate(run, queue="pm_nobody")
    command = [sys.executable, "-m", "celery", "-A", "tests.support.worker_app", "purge", "-f"]
    purged = subprocess.run(
        [*command, "-Q", "pm_nobody"],
        env={**os.environ, **run.mode.env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert purged.returncode == 0, purged.stderr
    assert "Purged 1 message" in purged.stdout, purged.stdout
    left = [info for info in admin.locks(run.wa.app, run.key) if info.key == run.key]
    if run.lock_on == "execute":
        assert left == []  # nothing is locked before a worker runs it
    else:
        assert [(i.state, i.task_id) for i in left] == [("queued", first.id)], left
        # `celery dlock purge PREFIX --queued` does this for every key under a prefix.
        assert admin.release(run.wa.app, run.key, holder=left[0].holder)
    return [duplicate(run)]


def task_id_new(run: Run) -> list[Any]:
    return [duplicate(run, task_id=f"{run.name}-own-id")]


def task_id_repeated(run: Run) -> list[Any]:
    # The same task id published again while its first run holds the key: merged at publish
    # (enqueue), or requeued by the worker until the first run ends, then run (execute).
    first = run.task.apply_async(run.args(), task_id=f"{run.name}-fixed")
    run.journal.wait_for("start", id=first.id, timeout=20)
    again = duplicate(run, task_id=first.id)
    assert again.id == first.id
    return [first]


def body_retries(run: Run) -> list[Any]:
    return [run.task.apply_async(run.args("retry"))]


def body_retries_and_goes_on(run: Run) -> list[Any]:
    return [run.task.apply_async(run.args("retry_caught"))]


def body_replaces(run: Run) -> list[Any]:
    return [run.task.apply_async(run.args("replace"))]


def link_error_of_duplicate(run: Run) -> list[Any]:
    first = running_first(run)
    return [first, duplicate(run, link_error=run.wa.linked.s(run.name))]


def eager_while_running(run: Run) -> list[Any]:
    # task_always_eager in the caller (a test suite, say) while a worker runs the same call:
    # the eager call runs in the caller's process and meets the lock there.
    first = running_first(run)
    conf = run.wa.app.conf
    conf.task_always_eager = True
    try:
        eager = duplicate(run)
    finally:
        conf.task_always_eager = False
    return [first, eager]


def apply_while_running(run: Run) -> list[Any]:
    first = running_first(run)
    return [first, run.task.apply(run.args())]


ALL_KINDS = tuple(TASKS)

ROWS = [
    Row("delay", delay),
    Row("body-republishes-own-id", republish_own, runs={"execute": 2, "enqueue": 2}),
    Row("body-reschedules-itself", reschedule, runs={"execute": 2, "enqueue": 2}),
    Row("countdown", countdown),
    Row("eta-datetime-aware", eta_aware),
    Row("eta-datetime-naive", eta_naive),
    Row(
        "eta-iso-string",
        eta_iso_string,
        runs={"execute": (1, 2), "enqueue": 1},
        tasks={"enqueue": "seam_enqueued_short"},
    ),
    Row("expires-seconds", expires_seconds),
    Row("expires-datetime", expires_datetime),
    Row("expires-passed", expires_passed, after=expired_discarded),
    Row("expires-passed-iso-string", expires_passed_iso_string, after=expired_discarded),
    Row("priority", priority),
    Row("duplicate-while-running", merged_duplicate, secs=2.0),
    Row("send-task-by-name", send_task_by_name, secs=2.0),
    Row("signature-apply-async", signature_apply_async, secs=2.0),
    Row("celery-purge-between-calls", purged_between),
    Row("task-id-new", task_id_new),
    Row("task-id-repeated", task_id_repeated, runs={"execute": 2, "enqueue": 1}, secs=2.0),
    Row("retry", body_retries, runs={"execute": 2, "enqueue": 2}),
    Row(
        "retry-caught-by-the-body",
        body_retries_and_goes_on,
        runs={"execute": 2, "enqueue": 2},
    ),
    Row("replace", body_replaces, runs={"execute": 2, "enqueue": 2}),
    Row("link-error-of-duplicate", link_error_of_duplicate, lock_on=ALL_KINDS, secs=2.0),
    Row("eager-while-running", eager_while_running, secs=2.0),
    Row("apply-while-running", apply_while_running, secs=2.0),
    Row("group-of-duplicates", group_of_duplicates, lock_on=ALL_KINDS, secs=2.0),
    Row("chord-header-duplicate", chord_with_duplicate, lock_on=ALL_KINDS, secs=2.0),
    Row("chain-head-duplicate", chain_head_duplicate, lock_on=ALL_KINDS, secs=2.0),
    Row("chain-tail-duplicate", chain_tail_duplicate, lock_on=ALL_KINDS, secs=2.0),
    Row("link-of-duplicate", link_of_duplicate, lock_on=ALL_KINDS, secs=2.0, after=link_ran),
    Row("opt-out-subclass", opted_out, lock_on=COMPAT, runs={"singleton": (1, 3), "once": (1, 3)}),
]

#: The brokers: Redis for every case; RabbitMQ (AMQP headers, its own purge and expiry) for
#: the enqueue-time rows on a single Redis lock store, the path that publishes and reads
#: this library's message headers (execution-time mode takes nothing at publish, and the
#: other stores answer the same publish the same way).
BROKERS = ("redis", "rabbitmq")


def KEEP(params: dict[str, Any]) -> bool:  # a module hook, read by tests/conftest.py
    if params.get("broker_url", "redis") != "rabbitmq":
        return True
    return params.get("mode") == "single" and params.get("lock_on") == "enqueue"


CASES = [
    pytest.param(row, kind, id=f"{row.id}-{kind}")
    for row in ROWS
    for kind in row.lock_on
    if set(row.modes) & set(KIND_MODES[kind])
]


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broker_url(request: pytest.FixtureRequest, celery_base: str) -> str:
    """The broker of this module's workers and publishers: a Redis database, or this
    session's RabbitMQ (the ``rabbitmq_url`` fixture, which skips with one line where there
    is none)."""
    if getattr(request, "param", "redis") == "rabbitmq":
        url: str = request.getfixturevalue("rabbitmq_url")
        return url
    return with_db(celery_base, 10)


@pytest.fixture(scope="module", params=MODES)
def mode(request: pytest.FixtureRequest, celery_base: str, broker_url: str) -> Mode:
    """The lock store (as tests/support/celery_fixtures.py's ``mode``), on ``broker_url``."""
    from tests.support.celery_fixtures import ZK_SESSION

    if request.param == "zookeeper":
        url = request.getfixturevalue("zookeeper_session_url")
        found = make_mode("zookeeper", celery_base, lock_urls=[f"{url}?timeout={ZK_SESSION}"])
    elif request.param == "redlock5":
        found = make_mode("redlock5", celery_base, request.getfixturevalue("redlock_session_urls"))
    else:
        found = make_mode("single", celery_base)
    found.env["DLOCK_TEST_BROKER"] = broker_url
    return found


@pytest.fixture(scope="module")
def matrix_worker(mode: Mode, wa: Any) -> Iterator[Worker]:
    """One prefork worker per lock store, for every row."""
    journal = Journal(mode.env["DLOCK_TEST_JOURNAL"])
    started = Worker(mode.env, journal, name=f"pm-{mode.name}", concurrency=4).start()
    yield started
    started.stop()


# -- the suite -----------------------------------------------------------------------------------


def most_at_once(entries: list[dict[str, Any]], name: str) -> int:
    """The most bodies of ``name`` running at once, from their start and end events."""
    running = most = 0
    for entry in sorted(entries, key=lambda e: e["t"]):
        if entry.get("name") != name:
            continue
        if entry["event"] == "start":
            running += 1
            most = max(most, running)
        elif entry["event"] == "end":
            running -= 1
    return most


def answer(result: Any, timeout: float) -> Any:
    """The value a caller gets, or fail naming what it waited on."""
    try:
        return result.get(timeout=timeout, propagate=False)
    except Exception as exc:  # a timeout: the caller would wait for ever
        raise AssertionError(f"{result!r} not ready after {timeout} s: {exc!r}") from exc


def values_of(value: Any) -> list[Any]:
    """A canvas's values flattened (a group's list, a chord's callback list)."""
    if isinstance(value, list):
        return [v for item in value for v in values_of(item)]
    return [value]


def wait_free(run: Run, timeout: float) -> float:
    manager = run.task._dlock().manager
    deadline = time.monotonic() + timeout
    while manager.holder(run.key) is not None:
        assert time.monotonic() < deadline, f"{run.key!r} still held after {timeout} s"
        time.sleep(0.01)
    return time.monotonic()


@pytest.mark.parametrize("broker_url", BROKERS, indirect=True)
@pytest.mark.parametrize(("row", "lock_on"), CASES)
def test_publish_shape(
    row: Row,
    lock_on: str,
    mode: Mode,
    wa: Any,
    journal: Journal,
    matrix_worker: Worker,
    broker_url: str,
) -> None:
    if mode.name not in row.modes or mode.name not in KIND_MODES[lock_on]:
        pytest.skip(f"{row.id} of {lock_on} is not run on {mode.name}")
    run = Run(wa, journal, mode, f"pm-{row.id}-{lock_on}-{mode.name}", lock_on, row.secs, row.tasks)
    fewest, most = row.bodies(lock_on)
    waits = row.publish(run)
    budget = row.secs * max(most, 1) + SLACK
    answers = [v for w in waits for v in values_of(answer(w, budget))]
    ran = {e["id"] for e in journal.select("start", name=run.name)}
    for value in answers:
        if isinstance(value, dict) and value.get("dlock_dropped"):
            # Dropped, naming a task that really ran (or runs): not merged into the dead.
            holder = value["holder"]
            assert holder in ran or journal.wait_for("start", id=holder, timeout=budget), value
        else:
            assert value == run.name, value
    if row.after is not None:
        row.after(run)
    ends = journal.wait_for("end", name=run.name, count=fewest, timeout=budget) if fewest else []
    last_end = max((e["t"] for e in ends), default=time.monotonic())
    freed = wait_free(run, timeout=PROMPT + 5)
    ends = journal.select("end", name=run.name)
    last_end = max((e["t"] for e in ends), default=last_end)
    assert freed - last_end < PROMPT + 0.5 or not ends, freed - last_end
    entries = journal.entries()
    assert most_at_once(entries, run.name) <= 1, [e for e in entries if e.get("name") == run.name]
    assert fewest <= len(ends) <= most, ends


# -- the table in docs/singleton.md -------------------------------------------------------------

TABLE_ROW = re.compile(r"^\| `(?P<id>[^`]+)`[^|]*\|(?P<cells>.*)\|\s*$")


def documented() -> set[str]:
    """``<row id>-<lock_on>-<mode>`` for every cell the table in docs/singleton.md marks."""
    section = DOCS.read_text().split("## Publish shapes", 1)[1].split("\n## ", 1)[0]
    columns = COLUMNS
    found = set()
    for line in section.splitlines():
        match = TABLE_ROW.match(line)
        if match is None:
            continue
        cells = [c.strip() for c in match.group("cells").split("|")][: len(columns)]
        for (kind, m), cell in zip(columns, cells, strict=True):
            if cell == "yes":
                found.add(f"{match.group('id')}-{kind}-{m}")
    return found


def test_the_table_and_the_matrix_agree() -> None:
    tested = {
        f"{row.id}-{kind}-{m}"
        for row in ROWS
        for kind in row.lock_on
        for m in row.modes
        if m in KIND_MODES[kind]
    }
    assert documented() == tested
