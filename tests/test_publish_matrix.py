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
store serves the whole module; the broker is the ``broker_url`` fixture's (one Redis database
today), so that another broker is one more parameter there.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.celery_fixtures import Mode, make_mode, with_db
from tests.workers import Journal, Worker

pytestmark = [pytest.mark.slow]

MODES = ("single", "redlock5", "zookeeper")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "singleton.md"
#: The task of each ``lock_on`` (tests/worker_app.py).
TASKS = {"execute": "seam", "enqueue": "seam_enqueued"}
LOCK_ONS = tuple(TASKS)
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

    @property
    def task(self) -> Any:
        return getattr(self.wa, TASKS[self.lock_on])

    @property
    def key(self) -> str:
        return f"seam:{self.name}"

    def args(self, how: str = "return") -> tuple[Any, ...]:
        return (self.name, how, self.secs)


#: What a row's publish gives back: the results and canvases its callers wait on.
Publish = Callable[[Run], list[Any]]


@dataclass(frozen=True)
class Row:
    """One publishing shape."""

    id: str
    publish: Publish
    #: Bodies that run, per ``lock_on``.
    runs: dict[str, int] = field(default_factory=lambda: {"execute": 1, "enqueue": 1})
    lock_on: tuple[str, ...] = LOCK_ONS
    modes: tuple[str, ...] = MODES
    secs: float = 1.0


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


ROWS = [
    Row("delay", delay),
    Row("body-republishes-own-id", republish_own, runs={"execute": 2, "enqueue": 2}),
    Row("body-reschedules-itself", reschedule, runs={"execute": 2, "enqueue": 2}),
]

CASES = [
    pytest.param(row, lock_on, id=f"{row.id}-{lock_on}") for row in ROWS for lock_on in row.lock_on
]


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broker_url(celery_base: str) -> str:
    """The broker of this module's workers and publishers (a parameter for other brokers)."""
    return with_db(celery_base, 10)


@pytest.fixture(scope="module", params=MODES)
def mode(request: pytest.FixtureRequest, celery_base: str, broker_url: str) -> Mode:
    """The lock store (as tests/celery_fixtures.py's ``mode``), on ``broker_url``."""
    from tests.celery_fixtures import ZK_SESSION

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


@pytest.mark.parametrize(("row", "lock_on"), CASES)
def test_publish_shape(
    row: Row,
    lock_on: str,
    mode: Mode,
    wa: Any,
    journal: Journal,
    matrix_worker: Worker,
) -> None:
    if mode.name not in row.modes:
        pytest.skip(f"{row.id} does not apply on {mode.name}")
    run = Run(wa, journal, mode, f"pm-{row.id}-{lock_on}-{mode.name}", lock_on, row.secs)
    runs = row.runs[lock_on]
    waits = row.publish(run)
    budget = row.secs * max(runs, 1) + SLACK
    answers = [v for w in waits for v in values_of(answer(w, budget))]
    ran = {e["id"] for e in journal.select("start", name=run.name)}
    for value in answers:
        if isinstance(value, dict) and value.get("dlock_dropped"):
            # Dropped, naming a task that really ran (or runs): not merged into the dead.
            holder = value["holder"]
            assert holder in ran or journal.wait_for("start", id=holder, timeout=budget), value
        else:
            assert value == run.name, value
    ends = journal.wait_for("end", name=run.name, count=runs, timeout=budget) if runs else []
    last_end = max((e["t"] for e in ends), default=time.monotonic())
    freed = wait_free(run, timeout=PROMPT + 5)
    assert freed - last_end < PROMPT + 0.5 or runs == 0, freed - last_end
    entries = journal.entries()
    assert most_at_once(entries, run.name) <= 1, [e for e in entries if e.get("name") == run.name]
    assert len(journal.select("end", name=run.name)) == runs, journal.select("end", name=run.name)


# -- the table in docs/singleton.md -------------------------------------------------------------

TABLE_ROW = re.compile(r"^\| `(?P<id>[^`]+)`[^|]*\|(?P<cells>.*)\|\s*$")


def documented() -> set[str]:
    """``<row id>-<lock_on>-<mode>`` for every cell the table in docs/singleton.md marks."""
    section = DOCS.read_text().split("## Publish shapes", 1)[1].split("\n## ", 1)[0]
    columns = [(lock_on, m) for lock_on in LOCK_ONS for m in MODES]
    found = set()
    for line in section.splitlines():
        match = TABLE_ROW.match(line)
        if match is None:
            continue
        cells = [c.strip() for c in match.group("cells").split("|")][: len(columns)]
        for (lock_on, m), cell in zip(columns, cells, strict=True):
            if cell == "yes":
                found.add(f"{match.group('id')}-{lock_on}-{m}")
    return found


def test_the_table_and_the_matrix_agree() -> None:
    tested = {
        f"{row.id}-{lock_on}-{m}" for row in ROWS for lock_on in row.lock_on for m in row.modes
    }
    assert documented() == tested
