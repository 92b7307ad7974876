"""A rolling upgrade across the refactor: workers of 205c568 and of main share one broker, one
result backend and one lock store, as they do while a deployment is being upgraded.

The old worker runs ``tests.worker_app`` (unchanged by the refactor) from ``git archive
205c568`` of the whole tree; the new one runs this tree. Skipped when the clone lacks the commit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import LockContended
from tests.support.celery_fixtures import Mode, make_mode
from tests.support.clients import client
from tests.support.old_tree import run_old, unpack
from tests.support.workers import Beat, Journal, Worker, intervals, overlaps

pytestmark = [pytest.mark.slow]

OLD_Q = "rolling_old_q"
NEW_Q = "rolling_new_q"


@pytest.fixture(scope="module")
def old_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return unpack(tmp_path_factory, "old205-tree", "celery_dlock", "tests")


class OldWorker(Worker):
    """A worker whose code is 205c568's (its own tests.worker_app and celery_dlock)."""

    def __init__(self, root: Path, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("app", "tests.worker_app")  # where the old tree has it
        super().__init__(*args, **kwargs)
        self.root = root

    def start(self, timeout: float = 30) -> Worker:
        args = [
            sys.executable, "-m", "celery", "-A", self.app, "worker",
            "-P", self.pool, "-c", str(self.concurrency), "-n", self.hostname,
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-l", "INFO", "--logfile", str(self.logfile), "-Q", str(self.queue),
        ]  # fmt: skip
        env = {**os.environ, **self.env, "PYTHONPATH": str(self.root)}
        self.process = subprocess.Popen(args, env=env, cwd=self.root, start_new_session=True)
        try:
            self.journal.wait_for("worker_ready", timeout=timeout, hostname=self.hostname)
        except AssertionError:
            raise AssertionError(f"old worker did not start; log:\n{self.log()}") from None
        return self


@pytest.fixture(scope="module")
def mode(celery_base: str) -> Mode:
    return make_mode("single", celery_base)


@pytest.fixture(scope="module")
def old_worker(mode: Mode, wa: Any, old_root: Path) -> Iterator[Worker]:
    journal = Journal(mode.env["DLOCK_TEST_JOURNAL"])
    started = OldWorker(old_root, mode.env, journal, name="old205", queue=OLD_Q, concurrency=2)
    started.start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def new_worker(mode: Mode, wa: Any) -> Iterator[Worker]:
    journal = Journal(mode.env["DLOCK_TEST_JOURNAL"])
    started = Worker(mode.env, journal, name="new", queue=NEW_Q, concurrency=2).start()
    yield started
    started.stop()


def old_publish(old_root: Path, mode: Mode, code: str) -> str:
    """Run ``code`` with 205c568's tests.worker_app imported as ``wa``; its stdout."""
    return run_old(old_root, mode.env, f"from tests import worker_app as wa\n{code}")


def _lock_keys(mode: Mode) -> list[bytes]:
    keys: list[Any] = list(client(mode.lock_urls[0]).keys("*"))
    return [k for k in keys if not k.endswith(b":fence")]


def test_an_enqueued_task_published_by_new_code_runs_on_an_old_worker(
    wa: Any, journal: Journal, old_worker: Worker, mode: Mode
) -> None:
    result = wa.enqueued.apply_async(("roll-new-pub",), queue=OLD_Q)
    assert result.get(timeout=20) == "roll-new-pub"
    journal.wait_for("end", name="roll-new-pub")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(b"roll-new-pub" in k for k in _lock_keys(mode)):
        time.sleep(0.05)
    assert [k for k in _lock_keys(mode) if b"roll-new-pub" in k and b":signal" not in k] == []


def test_an_enqueued_task_published_by_old_code_runs_on_a_new_worker(
    wa: Any, journal: Journal, new_worker: Worker, old_root: Path, mode: Mode
) -> None:
    task_id = old_publish(
        old_root, mode, f"print(wa.enqueued.apply_async(('roll-old-pub',), queue={NEW_Q!r}).id)"
    )
    assert wa.app.AsyncResult(task_id).get(timeout=20) == "roll-old-pub"
    journal.wait_for("end", name="roll-old-pub")


def test_old_and_new_workers_never_run_one_key_at_once(
    wa: Any, journal: Journal, old_worker: Worker, new_worker: Worker
) -> None:
    results = []
    for i in range(6):
        results.append(wa.drop_task.apply_async(("roll-mixed", 0.6), queue=(OLD_Q, NEW_Q)[i % 2]))
        time.sleep(0.1)
    for r in results:
        r.get(timeout=20, propagate=False)
    assert overlaps(intervals(journal.entries(), name="roll-mixed")) == []
    assert journal.select("contended", policy="drop")


def test_a_duplicate_an_old_worker_raises_reaches_a_new_client_with_its_holder(
    wa: Any, journal: Journal, old_worker: Worker, new_worker: Worker
) -> None:
    first = wa.raise_task.apply_async(("roll-raise", 1, 2.0), queue=NEW_Q)
    journal.wait_for("start", name="roll-raise")
    second = wa.raise_task.apply_async(("roll-raise", 2, 0.0), queue=OLD_Q)
    with pytest.raises(LockContended) as caught:
        second.get(timeout=20)
    assert caught.value.holder is not None
    assert caught.value.holder.task_id == first.id
    assert caught.value.holder.task_id == first.id
    assert first.get(timeout=20) == 1


class OldBeat(Beat):
    """A ``celery beat`` whose code is 205c568's."""

    def __init__(self, root: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.root = root

    def start(self) -> Beat:
        args = [
            sys.executable, "-m", "celery", "-A", "tests.worker_app", "beat",
            "-s", str(self.directory / "schedule"), "--pidfile=", "-l", "INFO",
            "--logfile", str(self.logfile), "--max-interval", "1",
            *(["-S", self.scheduler] if self.scheduler else []),
        ]  # fmt: skip
        env = {**os.environ, **self.env, "PYTHONPATH": str(self.root)}
        self.process = subprocess.Popen(args, env=env, cwd=self.directory, start_new_session=True)
        return self


def test_an_old_leader_beat_and_a_new_follower_send_each_tick_once_and_fail_over(
    wa: Any, worker: Worker, journal: Journal, mode: Mode, old_root: Path
) -> None:
    env = {**mode.env, "DLOCK_TEST_BEAT": "rolled:0", "DLOCK_TEST_BEAT_TTL": "3"}
    old = OldBeat(old_root, env, name="old-leader", scheduler="dlock").start()
    try:
        journal.wait_for("start", timeout=15, name="rolled")  # the old beat leads
        new = Beat(env, name="new-follower", scheduler="dlock").start()
        new_pid = new.pid
        try:
            time.sleep(5)
            before = journal.select("start", name="rolled")
            assert len({s["beat"] for s in before}) == 1, before
            assert journal.select("contended", policy="drop") == []
            old.kill()
            killed_at = time.monotonic()
            time.sleep(8)
        finally:
            new.stop()
    finally:
        if old.process is not None:
            old.stop()
    starts = journal.select("start", name="rolled")
    # Starts are dated by the worker, not by the send: a tick the old leader sent just before
    # it was killed can start after ``killed_at``. Those come first; then only the new beat's.
    senders = [int(s["beat"].rsplit(":", 1)[1]) for s in starts if s["t"] > killed_at]
    assert new_pid in senders, "the new beat never took over from the old leader"
    taken_over = senders.index(new_pid)
    assert set(senders[taken_over:]) == {new_pid}, senders
    per_slot = Counter(int(s["tick"].rsplit(":", 1)[1]) for s in starts)
    assert all(n == 1 for n in per_slot.values()), per_slot


# -- the compat classes across the upgrade (tests.compat_app, unchanged by the refactor) -------

OLD_CQ = "rolling_compat_old_q"
NEW_CQ = "rolling_compat_new_q"
PARKED_Q = "rolling_compat_parked_q"  # no worker reads it: its messages stay queued


def old_compat(old_root: Path, compat_mode: Mode, code: str) -> str:
    return run_old(old_root, compat_mode.env, f"from tests import compat_app as ca\n{code}")


@pytest.fixture(scope="module")
def old_compat_worker(compat_mode: Mode, ca: Any, old_root: Path) -> Iterator[Worker]:
    journal = Journal(compat_mode.env["DLOCK_TEST_JOURNAL"])
    started = OldWorker(
        old_root, compat_mode.env, journal, name="old205-compat", queue=OLD_CQ, concurrency=2,
        app="tests.compat_app",
    )  # fmt: skip
    started.start()
    yield started
    started.stop()


def test_a_singleton_published_by_new_code_runs_on_an_old_worker_and_frees_its_key(
    ca: Any, compat_journal: Journal, old_compat_worker: Worker
) -> None:
    first = ca.simple_task.apply_async((11,), queue=OLD_CQ)
    assert first.get(timeout=20) == [11]
    time.sleep(0.5)
    again = ca.simple_task.apply_async((11,), queue=OLD_CQ)
    assert again.id != first.id, "the old worker left the key held"
    assert again.get(timeout=20) == [11]


def test_new_code_merges_a_duplicate_of_a_singleton_the_old_code_queued(
    ca: Any, compat_journal: Journal, compat_mode: Mode, old_root: Path
) -> None:
    queued = old_compat(
        old_root, compat_mode, f"print(ca.simple_task.apply_async((12,), queue={PARKED_Q!r}).id)"
    )
    assert ca.simple_task.apply_async((12,), queue=PARKED_Q).id == queued


def test_new_code_refuses_a_queue_once_duplicate_the_old_code_queued(
    ca: Any, compat_journal: Journal, compat_mode: Mode, old_root: Path
) -> None:
    from celery_dlock.compat import AlreadyQueued

    old_compat(old_root, compat_mode, f"ca.args_example.apply_async((1, 2), queue={PARKED_Q!r})")
    with pytest.raises(AlreadyQueued):
        ca.args_example.apply_async((1, 2), queue=PARKED_Q)


def test_old_code_refuses_a_queue_once_duplicate_the_new_code_queued(
    ca: Any, compat_journal: Journal, compat_mode: Mode, old_root: Path
) -> None:
    ca.args_example.apply_async((3, 4), queue=PARKED_Q)
    out = old_compat(
        old_root,
        compat_mode,
        "from celery_dlock.compat import AlreadyQueued\n"
        "try:\n"
        f"    ca.args_example.apply_async((3, 4), queue={PARKED_Q!r})\n"
        "    print('published')\n"
        "except AlreadyQueued:\n"
        "    print('refused')\n",
    )
    assert out == "refused"
