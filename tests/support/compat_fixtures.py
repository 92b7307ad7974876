"""Fixtures of the compat tests: ``tests.support.compat_app`` in this process, its journal, and one
real ``celery worker`` of it per test module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.support.celery_fixtures import Mode, make_mode, point_at_broker, with_db
from tests.support.clients import client
from tests.support.workers import Journal, Worker


@pytest.fixture(scope="session")
def compat_mode(celery_base: str) -> Mode:
    """Single Redis: locks (the peers' settings point there) and journal as for the other
    worker tests, but a broker (db 14) and results (db 15) of their own, so that no other
    module's worker takes the compat app's messages, nor the compat worker theirs."""
    mode = make_mode("single", celery_base)
    mode.env["DLOCK_TEST_BROKER"] = with_db(celery_base, 14)
    mode.env["DLOCK_TEST_BACKEND"] = with_db(celery_base, 15)
    return mode


@pytest.fixture(scope="session")
def ca(compat_mode: Mode) -> ModuleType:
    """This process's copy of ``tests.support.compat_app``, pointed at the session's servers."""
    os.environ.update(compat_mode.env)
    from tests.support import compat_app

    point_at_broker(compat_app.app, compat_mode.env["DLOCK_TEST_BROKER"])
    compat_app.app.conf.result_backend = compat_mode.env["DLOCK_TEST_BACKEND"]
    return compat_app


@pytest.fixture
def compat_journal(compat_mode: Mode, ca: ModuleType) -> Journal:
    """The journal, emptied, and the lock database flushed: each test starts with no locks."""
    journal = Journal(compat_mode.env["DLOCK_TEST_JOURNAL"])
    journal.clear()
    for url in compat_mode.lock_urls:
        client(url).flushdb()
    return journal


@pytest.fixture(scope="module")
def compat_worker(compat_mode: Mode, ca: ModuleType) -> Iterator[Worker]:
    journal = Journal(compat_mode.env["DLOCK_TEST_JOURNAL"])
    worker = Worker(compat_mode.env, journal, name="compat", app="tests.support.compat_app")
    worker.start()
    yield worker
    worker.stop()
