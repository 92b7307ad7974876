"""The README's commands' shared set-up (scripts/_venv.sh): where the virtualenv comes from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def test_a_relative_dlock_venv_is_relative_to_where_the_command_runs(tmp_path: Path) -> None:
    venv = Path(sys.prefix)
    relative = os.path.relpath(venv, tmp_path)
    assert which_python(relative, tmp_path) == str(tmp_path / relative / "bin" / "python")


def test_the_demo_runs_from_any_directory_and_reads_paths_from_there(tmp_path: Path) -> None:
    script = f'. "{ROOT}/scripts/_venv.sh" demo >/dev/null && echo "$caller|$repo|$PWD"'
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env={**os.environ, "DLOCK_VENV": sys.prefix},
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.stdout.strip() == f"{tmp_path}|{ROOT}|{ROOT}", done.stderr
    # demo.sh goes back to $caller and finds its package from there: only the argument check
    # runs here (a wrong suffix is refused before anything starts).
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh"), "--timeline", "runs.txt"], cwd=tmp_path,
        env={**os.environ, "DLOCK_VENV": str(sys.prefix)}, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--timeline runs.txt: the file name must end in .svg or .html" in done.stderr


def test_an_install_says_one_line_not_setuptools_banner(tmp_path: Path) -> None:
    # The demo's first install printed setuptools' editable-install banner ("Please be
    # careful with folders in your working directory...") before anything of the demo's.
    # A fresh virtualenv, as a newcomer's first run makes (pip's cache makes it quick).
    venv = tmp_path / "venv"
    script = f'. "{ROOT}/scripts/_venv.sh" demo && echo installed'
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env={**os.environ, "DLOCK_VENV": str(venv)},
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "installed\n"
    said = done.stderr.splitlines()
    assert said == [f"== installing celery-dlock[demo] into {venv}"], done.stderr
    assert (venv / "bin" / "celery").exists()
