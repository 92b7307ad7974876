"""Breaks found by attacking the fixes of issues 17 and 18 the way a deployment would.

Each test here failed before its fix (or is marked ``xfail(strict=True)`` with the reason it
still does): real prefork workers and real redis-server processes, as everywhere else.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.celery_fixtures import Mode, make_mode, node_timeout
from tests.support.workers import Journal, Worker, intervals, overlaps

pytestmark = [pytest.mark.slow, pytest.mark.local_redis]


@pytest.fixture(scope="module")
def mode(celery_base: str) -> Mode:
    """Celery-side seams: one Redis for the locks is enough."""
    return make_mode("single", celery_base)


QUEUE = "breaks_q"


@pytest.fixture(scope="module")
def breaker(mode: Mode, wa: Any) -> Iterator[Worker]:
    """One prefork worker with two pool processes for the whole module, on its own queue."""
    journal = Journal(mode.env["DLOCK_TEST_JOURNAL"])
    started = Worker(mode.env, journal, name="breaker", queue=QUEUE, concurrency=2).start()
    yield started
    started.stop()


# -- retry(throw=False): the body goes on, so the key must stay with it ------------------------


@pytest.mark.parametrize("task", ["seam", "seam_enqueued"], ids=["execute", "enqueue"])
def test_a_retry_that_does_not_throw_keeps_the_key_until_the_body_ends(
    wa: Any, journal: Journal, breaker: Worker, task: str
) -> None:
    # Celery's retry(throw=False) publishes the retry and returns: the body goes on. In
    # enqueue-time mode the key used to pass to the retry message at that publish, so the
    # retried run took it over on another pool process while the first body still ran.
    queue = QUEUE
    name = f"nothrow-{task}"
    first = getattr(wa, task).apply_async((name, "retry_nothrow", 2.0), queue=queue)
    assert first.get(timeout=20) == name
    ends = journal.wait_for("end", timeout=20, count=2, name=name)
    assert sorted(e["retries"] for e in ends) == [0, 1]
    assert overlaps(intervals(journal.entries(), name=name)) == []


# -- enqueue-time mode: a second publish of one task id while its message waits ----------------


def test_a_second_publish_of_a_waiting_task_id_is_merged_not_sent_again(
    wa: Any, journal: Journal, breaker: Worker
) -> None:
    # Fixed task ids are a common idempotency idiom (task_id=f"report-{day}"). While the
    # first message waits (a countdown), publishing the same id and arguments again must be
    # merged into it like any duplicate; a second message with the same id would run the
    # body a second time after the first.
    queue = QUEUE
    name = "same-id"
    first = wa.seam_enqueued.apply_async((name, "return", 0.5), queue=queue, countdown=1.5)
    again = wa.seam_enqueued.apply_async(
        (name, "return", 0.5), queue=queue, countdown=1.5, task_id=first.id
    )
    assert again.id == first.id
    assert first.get(timeout=15) == name
    # A second message of that id would start within its countdown plus a requeue.
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        assert len(journal.select("start", name=name)) == 1, journal.select("start", name=name)
        time.sleep(0.1)


def test_a_task_id_sent_again_by_name_does_not_replace_its_result(
    wa: Any, journal: Journal, breaker: Worker
) -> None:
    # The same through send_task (by name, so the publish cannot be called off) while the
    # task runs: the second message is marked a duplicate of its own id and dropped by the
    # worker. The drop must store nothing: the backend keeps the first SUCCESS stored for an
    # id, so the drop's result would stand in for the real run's.
    queue = QUEUE
    name = "same-id-sent"
    # Other modules' apps in this test process register the name too (other lock stores):
    # send_task by name is checked with the sending app's copy, this module's.
    first = wa.seam_enqueued.apply_async((name, "return", 1.5), queue=queue)
    journal.wait_for("start", id=first.id)
    # A publish that cannot reach the lock store in dlock_node_timeout goes out unmarked (the
    # worker's own lock then keeps the copies apart): 0.5 s in this app, which a loaded CI
    # host's test process can miss. This test is about the marked path.
    with node_timeout(wa.app, 2.0):
        wa.app.send_task(
            wa.seam_enqueued.name, (name, "return", 1.5), task_id=first.id, queue=queue
        )
    journal.wait_for("contended", timeout=15, id=first.id, policy="drop")
    assert first.get(timeout=15) == name
    assert len(journal.select("start", name=name)) == 1
