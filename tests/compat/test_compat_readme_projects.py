"""A project written for celery-singleton and one written for celery-once (their READMEs'
examples and settings, tests/support/peer_projects/) run with only the import changed, each by
its own real ``celery worker``; the calling code below is the READMEs' own, in order.

Where the README promises what celery_dlock deliberately does otherwise (celery-singleton's
``lock_expiry`` letting a second run start while the first still runs), the test asserts ours
and says why; docs/migrating.md lists it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from celery import states

from celery_dlock.compat import AlreadyQueued, DuplicateTaskError
from celery_dlock.ops import admin
from tests.support.celery_fixtures import Mode, with_db
from tests.support.clients import client
from tests.support.workers import Journal, Worker

pytestmark = pytest.mark.slow

SINGLETON_SCALE = 0.25  # celery-singleton's README durations x 0.25: do_stuff sleeps 1 s
ONCE_SCALE = 0.05  # celery-once's README sleeps 30 s: 1.5 s here


class ProjectWorker(Worker):
    """A worker of a project that writes no journal: ready when its log says so."""

    def start(self, timeout: float = 30) -> ProjectWorker:
        import subprocess

        args = [
            sys.executable, "-m", "celery", "-A", self.app, "worker", "-P", "prefork",
            "-c", str(self.concurrency), "-n", self.hostname, "--without-gossip",
            "--without-mingle", "--without-heartbeat", "-l", "INFO",
            "--logfile", str(self.logfile),
        ]  # fmt: skip
        env = {**os.environ, **self.env}
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.process = subprocess.Popen(args, env=env, cwd=root, start_new_session=True)
        deadline = time.monotonic() + timeout
        while " ready." not in self.log():
            assert self.process.poll() is None, f"worker exited:\n{self.log()}"
            assert time.monotonic() < deadline, f"worker not ready:\n{self.log()}"
            time.sleep(0.05)
        return self


@contextlib.contextmanager
def project(name: str, compat_mode: Mode, scale: float, db: int) -> Iterator[ModuleType]:
    """Import ``tests.support.peer_projects.<name>`` here and start a worker of it."""
    base = compat_mode.env["DLOCK_TEST_BROKER"]
    env = {
        "PEER_BROKER": with_db(base, db),
        "PEER_BACKEND": with_db(base, db + 1),
        "PEER_LOCKS": with_db(base, db + 2),
        "PEER_README_SCALE": str(scale),
    }
    for url in env.values():
        if url.startswith("redis://"):
            client(url).flushdb()
    os.environ.update(env)
    module = importlib.import_module(f"tests.support.peer_projects.{name}")
    journal = Journal(compat_mode.env["DLOCK_TEST_JOURNAL"])  # unused by the project
    worker = ProjectWorker(env, journal, name=name, app=f"tests.support.peer_projects.{name}")
    worker.start()
    try:
        yield module
    finally:
        worker.stop()
        assert "Traceback" not in worker.log(), worker.log()


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def test_celery_singleton_readme_project(compat_mode: Mode) -> None:
    with project("singleton_project", compat_mode, SINGLETON_SCALE, 2) as proj:
        do_stuff = proj.do_stuff
        # Quick start
        async_result = do_stuff.delay(1, 2, 3, a="b")
        async_result2 = do_stuff.delay(1, 2, 3, a="b")
        assert async_result == async_result2  # These are the same, task is only queued once

        # How does it work?
        a = do_stuff.delay(1, 2, 3)
        b = do_stuff.delay(1, 2, 3)
        assert a == b  # Both are AsyncResult for the same task
        c = do_stuff.delay(4, 5, 6)
        assert a != c  # c has different arguments so it spawns a new task
        assert a.get(timeout=15) == "I just woke up"  # wait for a to finish
        d = do_stuff.delay(1, 2, 3)  # Now we can spawn a duplicate of it
        assert a != d

        # unique_on
        task1 = proj.do_something.delay(username="bob", otherarg=99)
        task2 = proj.do_something.delay(username="bob", otherarg=100)  # a duplicate of task1
        assert task1 == task2
        # celery_dlock: the positional spelling is the same call (celery-singleton: also, here,
        # because unique_on binds the arguments; without unique_on it would be a second key)
        assert proj.do_something.delay("bob") == task1

        # raise_on_duplicate
        first = proj.do_something_else.delay("bob")
        with pytest.raises(DuplicateTaskError) as info:
            proj.do_something_else.delay("bob")
        assert info.value.task_id == first.id

        # lock_expiry: README: after 11 of the 12 seconds the key has expired (10 s), so a
        # second run starts while the first still runs. celery_dlock renews a running task's
        # key: the call is merged into the running task (deliberate: no overlap).
        started = time.monotonic()
        expiring = proj.runs_for_12_seconds.delay()
        wait_until(lambda: time.monotonic() - started > 10.5 * SINGLETON_SCALE, 10, "the expiry")
        again = proj.runs_for_12_seconds.delay()
        assert not expiring.ready(), "the first run ended already: the check proves nothing"
        assert again == expiring
        assert expiring.get(timeout=15) is None
        for result in (async_result, c, d, task1, first):
            result.get(timeout=15)


def test_celery_once_readme_project(compat_mode: Mode) -> None:
    with project("once_project", compat_mode, ONCE_SCALE, 5) as proj:
        manager = proj.slow_task._dlock().manager
        # Usage: a second .delay() / .apply_async() before the first completes raises
        first = proj.slow_task.delay()
        with pytest.raises(AlreadyQueued):
            proj.slow_task.delay()
        with pytest.raises(AlreadyQueued):
            proj.slow_task.apply_async()

        # graceful: per call, and by default on the task
        result = proj.slow_task.apply_async(once={"graceful": True})
        assert result.result is None
        assert result.state == states.REJECTED
        graceful = proj.slow_task_graceful.delay()
        assert proj.slow_task_graceful.delay().result is None

        # keys: by default the name and every argument; keys=['a'] only a; keys=[] none
        adds = [proj.slow_add.delay(1, 1), proj.slow_add.delay(1, 2)]
        on_a = proj.slow_add_on_a.delay(1, 1)
        with pytest.raises(AlreadyQueued):
            proj.slow_add_on_a.delay(1, 2)
        on_a2 = proj.slow_add_on_a.delay(2, 2)
        any_args = proj.slow_add_any.delay(1, 1)
        with pytest.raises(AlreadyQueued):
            proj.slow_add_any.delay(2, 2)

        # timeout: the key of a queued long_running_task lives 10 hours
        long_run = proj.long_running_task.delay()
        info = admin.show(manager, proj.long_running_task.get_key())
        assert info.task_id == long_run.id
        assert info.ttl_left is not None
        assert 10 * 3600 - 60 < info.ttl_left <= 10 * 3600
        # celery-once keeps that key for the rest of the 10 hours after a revoke; ours frees it
        long_run.revoke(terminate=True)
        wait_until(
            lambda: manager.holder(proj.long_running_task.get_key()) is None, 15, "the revoke"
        )
        relaunched = proj.long_running_task.delay()  # accepted again at once
        assert relaunched.id != long_run.id
        relaunched.revoke(terminate=True)

        # unlock_before_run: once the run starts, the same call can be queued again
        unlocked = proj.slow_task_unlocked.delay()
        key = proj.slow_task_unlocked.get_key()
        wait_until(lambda: manager.holder(key) is None, 15, "the run to start")
        queued_again = proj.slow_task_unlocked.delay()
        assert queued_again.id != unlocked.id

        assert first.get(timeout=30) == "Done!"
        wait_until(lambda: manager.holder(proj.slow_task.get_key()) is None, 10, "the release")
        after = proj.slow_task.delay()  # the lock cleared when the task completed
        for done in (after, graceful, *adds, on_a, on_a2, any_args, unlocked, queued_again):
            done.get(timeout=30)
        assert [r.get() for r in adds] == [2, 3]
        wait_until(
            lambda: relaunched.state == states.REVOKED and long_run.state == states.REVOKED,
            15,
            "the revoked states",
        )
