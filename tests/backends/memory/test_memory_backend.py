"""The in-process backend (``memory://``) beyond the shared contract
(tests/contract/test_backend_contract.py): freezegun moving its leases to expiry, its URL, and its
refusals where it cannot keep its promise (a prefork worker of several processes, a process
forked after the table's first use).
"""

from __future__ import annotations

import itertools
import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from celery import Celery
from celery._state import _set_task_join_will_block
from freezegun import freeze_time

from celery_dlock import ConfigError, LockContended, LockLost, lock
from celery_dlock.backends.memory import check_worker, store
from celery_dlock.core.clock import real_clock

_tables = itertools.count()


@pytest.fixture
def url() -> str:
    """A table of this test's own."""
    return f"memory://test-memory-{next(_tables)}"


def test_a_tick_past_the_ttl_loses_the_lease_and_the_next_holder_gets_a_larger_token(
    url: str,
) -> None:
    with freeze_time("2026-01-01 12:00:00") as clock:
        guard = lock([url], "job", ttl=30, renew=False)
        first = guard.acquire()
        with pytest.raises(LockContended):
            lock([url], "job").acquire()
        clock.tick(29)
        first.ensure()  # 29 s of a 30 s lease (less its 0.3 s drift allowance): still held
        clock.tick(1.5)
        assert first.lost
        assert first.valid_for == 0
        with pytest.raises(LockLost, match="validity ran out"):
            first.ensure()
        with lock([url], "job") as second:  # the store let the key go at the same tick
            assert second.token > first.token
        first.release()


def test_a_wait_under_a_frozen_clock_ends_in_real_time(url: str) -> None:
    with freeze_time("2026-01-01 12:00:00"), lock([url], "frozen", ttl=30):
        begun = real_clock()
        with pytest.raises(LockContended):
            lock([url], "frozen", wait=0.3).acquire()
        assert 0.29 <= real_clock() - begun < 5


def test_a_crashed_holder_frees_its_key_when_the_clock_is_ticked_past_its_ttl(url: str) -> None:
    """A holder that stops renewing and never releases (a crash, played by ``forget``): the
    key is held until the clock passes its ttl, then the next holder's token is larger."""
    with freeze_time("2026-01-01 12:00:00") as clock:
        crashed = lock([url], "crash", ttl=10).acquire()
        crashed.backend.forget(crashed)  # type: ignore[attr-defined]
        clock.tick(9.9)
        with pytest.raises(LockContended, match="held by a process"):
            lock([url], "crash").acquire()
        clock.tick(0.2)
        with lock([url], "crash") as lease:
            assert lease.token > crashed.token


@pytest.mark.parametrize(
    "bad",
    ["memory://a/b", "memory://:pw@host", "memory://x?opt=1", "memory://a b"],
)
def test_a_memory_url_is_a_name_only(bad: str) -> None:
    with pytest.raises(ConfigError, match="memory://<name>") as refused:
        lock([bad], "k")
    assert "pw" not in str(refused.value)


def test_one_memory_url_only() -> None:
    with pytest.raises(ConfigError, match=r"one, e\.g\."):
        lock(["memory://a", "memory://b"], "k")


@pytest.mark.parametrize(
    ("pool", "concurrency", "refused"),
    [
        ("prefork", 2, True),
        ("prefork", "auto", True),
        ("celery.concurrency.prefork", 4, True),
        ("processes", 8, True),
        ("prefork", 1, False),
        ("solo", 1, False),
        ("threads", 8, False),
        ("gevent", 100, False),
        ("celery.concurrency.thread", 8, False),
    ],
)
def test_check_worker(pool: str, concurrency: object, refused: bool) -> None:
    if refused:
        with pytest.raises(ConfigError, match="--concurrency 1"):
            check_worker(["memory://"], pool, concurrency)
    else:
        check_worker(["memory://"], pool, concurrency)


def test_a_prefork_worker_of_two_processes_is_refused_at_start(url: str) -> None:
    app = Celery("refused", broker="memory://", set_as_current=False)
    app.conf.dlock_urls = [url]
    try:
        with pytest.raises(SystemExit, match=r"ConfigError.*prefork pool of 2") as refused:
            app.WorkController(pool="prefork", concurrency=2)
        assert isinstance(refused.value.__cause__, ConfigError)
        app.WorkController(pool="solo", concurrency=1)  # one process: accepted
    finally:
        # A worker made in this thread marks it as a worker's (result.get() then refuses).
        _set_task_join_will_block(False)


def test_a_real_prefork_worker_exits_with_the_message(tmp_path: Path) -> None:
    (tmp_path / "memapp.py").write_text(
        textwrap.dedent(
            """
            from celery import Celery
            import celery_dlock

            app = Celery("memapp", broker="memory://")
            app.conf.dlock_urls = ["memory://"]
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "memapp", "worker", "-P", "prefork", "-c", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "ConfigError" in done.stderr
    assert "--concurrency 1" in done.stderr


def _take_in_child(url: str, conn: object) -> None:
    try:
        lock([url], "forked").acquire().release()
        conn.send("took it")  # type: ignore[attr-defined]
    except ConfigError as exc:
        conn.send(f"ConfigError: {exc}")  # type: ignore[attr-defined]


@pytest.mark.skipif(sys.platform == "win32", reason="no fork on Windows")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_process_forked_after_first_use_cannot_take_keys(url: str) -> None:
    with lock([url], "forked"):
        pass  # the table now belongs to this process
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=_take_in_child, args=(url, child))
    process.start()
    assert parent.poll(30)
    said = parent.recv()
    process.join(30)
    assert said.startswith("ConfigError"), said
    assert "forked from it" in said
    with lock([url], "forked"):  # still fine here
        pass


def test_a_fresh_table_in_a_new_process_is_fine(url: str) -> None:
    """spawn (a new interpreter, not a fork): its own table, nothing shared to pretend."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_take_in_child, args=(url, child))
    process.start()
    assert parent.poll(60)
    assert parent.recv() == "took it"
    process.join(30)
    assert store(url.split("://", 1)[1]).owner is None  # this process never took a key
