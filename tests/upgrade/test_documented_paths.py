"""Import paths that c53a04b's README, docs and example project showed users.

A deployment upgrading past the layering refactor keeps the code it copied from those pages:
each ``from X import Y`` below appears there (listed by where), and must still import. The
public names come from :mod:`celery_dlock`; these are the other paths the pages taught.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

# (module, name, where c53a04b showed it)
DOCUMENTED = [
    ("celery_dlock", "SingletonTask", "README.md, docs/migrating.md"),
    ("celery_dlock", "Lease", "example_project/lock_tour.py"),
    ("celery_dlock.lease", "Lease", "example_project/lock_tour.py"),
    ("celery_dlock.testing", "redis_servers", "example_project/lock_tour.py, demo.py"),
    ("celery_dlock.compat", "QueueOnce", "docs/migrating.md"),
    ("celery_dlock.compat", "AlreadyQueued", "docs/migrating.md"),
    ("celery_dlock.compat", "Singleton", "docs/migrating.md, docs/index.md"),
    ("celery_dlock.compat", "DuplicateTaskError", "docs/migrating.md"),
    ("celery_dlock.compat", "clear_locks", "docs/migrating.md"),
    ("celery_dlock.admin", "check", "docs/configuration.md"),
    (
        "celery_dlock.beat",
        "LeaderScheduler",
        "docs: celery beat -S celery_dlock.beat:LeaderScheduler",
    ),
    ("celery_dlock.cli", "dlock", "pyproject: the celery.commands entry point"),
    ("celery_dlock.task", "SingletonTask", "settings: task_cls='celery_dlock.task:SingletonTask'"),
]


@pytest.mark.parametrize(("module", "name", "where"), DOCUMENTED)
def test_an_import_the_old_docs_showed_still_works(module: str, name: str, where: str) -> None:
    found = getattr(importlib.import_module(module), name)
    public = importlib.import_module("celery_dlock")
    if hasattr(public, name):  # one object under both paths (isinstance, type hints agree)
        assert found is getattr(public, name)


def test_a_warnings_filter_naming_the_old_module_of_the_config_warning_still_applies(
    tmp_path: Path,
) -> None:
    # c53a04b defined DLockConfigWarning in celery_dlock.config (its repr and the file that
    # pytest's warnings summary names): a project's pytest configuration may filter it by that
    # path. pytest imports a filter's module when it starts; a missing one is a
    # PytestConfigWarning, an error under "-W error" (as docs/testing.md's project runs), and
    # the filter is dropped.
    (tmp_path / "test_warns.py").write_text(
        "import warnings\n"
        "import celery_dlock\n"
        "def test_warns():\n"
        "    warnings.warn('even number of nodes', celery_dlock.DLockConfigWarning)\n"
    )
    filters = ["-W", "error", "-W", "ignore::celery_dlock.config.DLockConfigWarning"]
    plain = ["-q", "-p", "no:cacheprovider", "-p", "no:celery_dlock"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *plain, *filters, "test_warns.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
