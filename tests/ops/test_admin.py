"""``celery_dlock.admin``: the operator command's powers from Python, on real Redis (single and
Redlock-5) and a real ZooKeeper server, and ``dlock check`` / the option checks at the moments
the docs name."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_dlock import ConfigError, LockInfo, LockLost, SingletonTask, admin, lock
from celery_dlock.core.registry import forget
from celery_dlock.testing import free_port
from tests.ops.test_cli import dlock

ROOT = Path(__file__).resolve().parents[2]
#: The ``urls`` fixture's stores this module runs on (tests/conftest.py).
MODES = ["single", "redlock5", "zookeeper"]


def on_zookeeper(urls: list[str]) -> bool:
    return urls[0].startswith("zookeeper://")


@pytest.fixture
def app(urls: list[str]) -> Any:
    app = Celery("admin_app", broker="memory://", set_as_current=False)
    app.conf.dlock_urls = urls
    app.conf.dlock_ttl = 3

    @app.task(base=SingletonTask, name="admin_app.replicate", shared=False)
    def replicate() -> None:
        """A singleton task of this app, so check() has one to create."""

    yield app
    forget(app)


def test_locks_show_release_and_purge_from_python(app: Any, urls: list[str]) -> None:
    lost = threading.Event()
    leases = [lock(urls, f"meta:crm:{n}", ttl=3, holder=f"task-{n}").acquire() for n in "abc"]
    leases[0].on_lost(lambda _lease, _error: lost.set())
    other = lock(app, "meta-other", ttl=3).acquire()
    try:
        listed = admin.locks(app, prefix="meta:crm:")
        assert [info.key for info in listed] == ["meta:crm:a", "meta:crm:b", "meta:crm:c"]
        assert all(isinstance(info, LockInfo) and info.held for info in listed)
        assert [info.task_id for info in listed] == ["task-a", "task-b", "task-c"]
        assert listed[0].as_dict()["fence"] == leases[0].token
        assert {i.key for i in admin.locks(urls)} >= {"meta:crm:a", "meta-other"}  # URL list

        shown = admin.show(app, "meta:crm:b")
        assert (shown.held, shown.task_id, shown.fence) == (True, "task-b", leases[1].token)
        if on_zookeeper(urls):
            assert shown.ttl_left is None  # no ttl: held while the holder's session lives
        else:
            assert 0 < (shown.ttl_left or 0) <= 3

        # Only while that task holds it: another task id releases nothing.
        assert admin.release(app, "meta:crm:a", task_id="task-zzz") is False
        assert admin.show(app, "meta:crm:a").held
        assert admin.release(app, "meta:crm:a", task_id="task-a") is True
        assert lost.wait(1 + 0.5), "the holder was not told at its next renewal"
        told = "deleted by another client" if on_zookeeper(urls) else "released by an operator"
        with pytest.raises(LockLost, match=told):
            leases[0].ensure()
        assert admin.release(app, "meta:crm:a") is False  # not held any more

        assert sorted(admin.purge(app, "meta:crm:")) == ["meta:crm:b", "meta:crm:c"]
        assert admin.locks(app, prefix="meta:crm:") == []
        assert admin.show(app, "meta-other").held
        with pytest.raises(ConfigError, match="non-empty prefix"):
            admin.purge(app, "")
    finally:
        for lease in [*leases, other]:
            lease.release()


def test_show_of_a_free_key(app: Any, urls: list[str]) -> None:
    never = admin.show(app, "never-locked")
    assert (never.held, never.holder, never.ttl_left, never.fence) == (False, None, None, None)
    with lock(app, "was-locked", ttl=2) as lease:
        pass
    freed = admin.show(app, "was-locked")
    if on_zookeeper(urls):
        # No counter is kept for a key without nodes: its next parent node starts anew.
        assert (freed.held, freed.fence) == (False, None)
        for key in ("never-locked", "was-locked"):
            assert dlock(urls, "show", key).stdout.strip() == f"{key!r} is not held"
        return
    assert (freed.held, freed.fence) == (False, lease.token)
    assert dlock(urls, "show", "never-locked").stdout.strip() == (
        "'never-locked' is not held, and no fencing token was ever issued for it"
    )
    shown = dlock(urls, "show", "was-locked").stdout.strip()
    assert shown == f"'was-locked' is not held; the last fencing token issued was {lease.token}"
    assert "None" not in shown


def test_check_reports_what_a_worker_would_meet(app: Any, urls: list[str]) -> None:
    report = admin.check(app)
    assert report.ok, report.problems
    assert "admin_app.replicate" in report.tasks  # (shared tasks of other apps join it)
    assert [error for _, error in report.nodes] == [None] * len(urls)
    assert report.quorum_reached


@pytest.mark.local_redis
def test_check_names_unreachable_nodes_with_passwords_hidden() -> None:
    app = Celery("admin_down", broker="memory://", set_as_current=False)
    ports = [free_port() for _ in range(3)]
    app.conf.dlock_urls = [f"redis://:pw-{p}@127.0.0.1:{p}/0" for p in ports]

    @app.task(base=SingletonTask, name="admin_down.t", shared=False)
    def t() -> None:
        """A singleton task whose nodes are all down."""

    try:
        report = admin.check(app)
    finally:
        forget(app)
    assert not report.ok
    assert not report.quorum_reached
    assert len(report.problems) == 3
    assert all("cannot reach lock node redis://:***@127.0.0.1:" in p for p in report.problems)
    assert not any("pw-" in p for p in report.problems)


MODULE = """
from celery import Celery
from celery_dlock import SingletonTask

app = Celery("{name}", broker="memory://")
app.conf.dlock_urls = ["redis://127.0.0.1:{port}/0"]


@app.task(base=SingletonTask, on_duplicate="reque")
def collect(source, entity):
    return source


@app.task(base=SingletonTask, lock_key="meta:{{sorce}}")
def assign(source, entity):
    return source
"""


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_when_a_wrong_task_option_is_reported(tmp_path: Path, single_urls: list[str]) -> None:
    port = single_urls[0].rsplit(":", 1)[1].split("/")[0]
    (tmp_path / "lazy_opts.py").write_text(MODULE.format(name="lazy_opts", port=port))
    # Celery creates @app.task classes on first use: importing the module says nothing.
    assert run(tmp_path, "lazy_opts.py").returncode == 0
    # The first use does, naming the task, the option, and the likely fix.
    used = run(tmp_path, "-c", "import lazy_opts; lazy_opts.collect.name")
    assert used.returncode != 0
    assert (
        "ConfigError: task 'lazy_opts.collect': on_duplicate='reque' is not one of 'drop', "
        "'requeue', 'raise', 'wait'. Did you mean 'requeue'?" in used.stderr
    )
    # So does `celery dlock check`, before any worker starts, with exit status 1.
    checked = run(tmp_path, "-m", "celery", "-A", "lazy_opts", "dlock", "check")
    assert checked.returncode == 1
    # Every wrong task, not only the first Celery happens to create.
    assert "problem: task 'lazy_opts.collect': on_duplicate='reque'" in checked.stderr
    assert "problem: task 'lazy_opts.assign': lock_key names 'sorce'" in checked.stderr
    assert "Did you mean 'source'?" in checked.stderr
    # A SingletonTask subclass is checked by its class statement: at import.
    (tmp_path / "eager_opts.py").write_text(
        textwrap.dedent(
            """
            from celery_dlock import SingletonTask

            class Collect(SingletonTask):
                lock_ttl = 0
            """
        )
    )
    imported = run(tmp_path, "eager_opts.py")
    assert imported.returncode != 0
    assert "lock_ttl must be > 0 seconds, got 0" in imported.stderr


def test_check_command_passes_a_good_app(urls: list[str]) -> None:
    done = dlock(urls, "check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 SingletonTask(s): cli_app.replicate" in done.stdout
    assert done.stdout.count(": ok\n") == len(urls)
    assert done.stdout.rstrip().endswith("ok")
