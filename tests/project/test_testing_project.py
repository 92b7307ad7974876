"""examples/testing_project, the user-shaped project of docs/testing.md, passes with this
checkout installed: its own pytest run (its pyproject's settings and conftest, none of this
suite's), on the in-process store and on the plugin's throwaway Redis.
scripts/test_example_project.sh runs it again from the built wheel in a fresh virtualenv."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[2] / "examples" / "testing_project"


@pytest.mark.slow
@pytest.mark.parametrize("store", ["memory", "redis"])
def test_the_example_project_passes(store: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DLOCK_"))}
    env["SHOP_LOCKS"] = store
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "--rootdir", str(PROJECT)],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    expected = "8 passed" if store == "memory" else "7 passed, 1 skipped"
    assert expected in done.stdout, done.stdout[-2000:]


def test_the_docs_page_shows_the_projects_files_as_they_are() -> None:
    """Every ``<!-- test: project FILE -->`` block of docs/testing.md is that file of
    examples/testing_project, whole, so what the page shows is what the project runs."""
    import re

    page = (PROJECT.parent.parent / "docs" / "testing.md").read_text()
    blocks = re.findall(r"<!-- test: project (\S+) -->\s*```python\n(.*?)```", page, re.S)
    assert {name for name, _ in blocks} == {
        "shop/tasks.py",
        "tests/conftest.py",
        "tests/test_duplicates.py",
        "tests/test_worker.py",
        "tests/test_beat.py",
        "tests/test_crash.py",
        "tests/test_dropin.py",
    }
    for name, code in blocks:
        assert code == (PROJECT / name).read_text(), name
    assert "```python" not in re.sub(r"<!-- test: project \S+ -->\s*```python", "", page)
