"""The README's commands' shared set-up (scripts/_venv.sh): where the virtualenv comes from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def which_python(venv: str, cwd: Path) -> str:
    """The ``python`` a README command would run, with ``DLOCK_VENV=venv``."""
    script = f'. "{ROOT}/scripts/_venv.sh" test >/dev/null && command -v python'
    done = subprocess.run(
        ["bash", "-c", script], cwd=cwd, env={**os.environ, "DLOCK_VENV": venv},
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_dlock_venv_may_be_an_absolute_path(tmp_path: Path) -> None:
    # This suite's own virtualenv, named by its absolute path, from another directory.
    venv = Path(sys.prefix)
    assert which_python(str(venv), tmp_path) == str(venv / "bin" / "python")


def test_dlock_venv_may_be_relative_to_the_repository(tmp_path: Path) -> None:
    venv = Path(sys.prefix)
    relative = os.path.relpath(venv, ROOT)
    assert which_python(relative, tmp_path) == str(ROOT / relative / "bin" / "python")
