"""The tutorial (docs/tutorial.md), run as written: a fresh virtualenv, the documented pip
lines (the package from this checkout), the throwaway Redis, ``proj.py``, a real worker, and
``try.py`` whose output must match the page's.

Only two things differ from what a user types: port 6379 becomes a free port, and the package
name ``celery-dlock`` becomes this checkout (``celery-dlock @ file://...``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_dlock.testing import free_port, terminate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "tutorial.md"
BLOCK = re.compile(r"<!-- test: quickstart (?P<what>[^>]*) -->\s*```\w*\n(?P<text>.*?)```", re.S)


def quickstart(port: int) -> dict[str, str]:
    """The page's quick-start blocks by their mark, with the user's port replaced."""
    blocks = {m["what"].strip(): m["text"] for m in BLOCK.finditer(PAGE.read_text())}
    assert set(blocks) >= {
        "shell server", "file proj.py", "shell worker", "file try.py", "output", "shell check",
        "check output",
    }  # fmt: skip
    return {what: text.replace("6379", str(port)) for what, text in blocks.items()}


def commands(text: str) -> list[list[str]]:
    return [shlex.split(line) for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv holding only what the page's pip lines install."""
    home = tmp_path_factory.mktemp("quickstart-venv")
    venv.create(home, with_pip=True)
    return home


def run_pip(env_bin: Path, args: list[str], source: Path) -> None:
    assert args[:2] == ["pip", "install"], args
    local = [re.sub(r"^celery-dlock(\[.*\])?$", rf"celery-dlock\1 @ {source.as_uri()}", a)
             for a in args[2:]]  # fmt: skip
    pip = [str(env_bin / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    done = subprocess.run([*pip, *local], capture_output=True, text=True, timeout=480, check=False)
    assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}"


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in reversed(processes):
        terminate(process)


def wait_for_line(path: Path, needle: str, process: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        if needle in text:
            return text
        assert process.poll() is None, f"exited with {process.returncode}:\n{text}"
        assert time.monotonic() < deadline, f"no {needle!r} in {timeout} s:\n{text}"
        time.sleep(0.05)


def test_the_quick_start_as_written(
    tmp_path: Path, user_venv: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    page = quickstart(port)
    bin_dir = user_venv / "bin"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)

    # Step 0 and 1: the install line from "Install", then the server's lines.
    install = next(m["text"] for m in re.finditer(r"## Install\s*```sh\n(?P<text>.*?)```",
                                                   PAGE.read_text(), re.S))  # fmt: skip
    # The package as a user's pip gets it: built from a copy (pip builds a local directory in
    # place, leaving build/ behind), with what the sdist holds.
    source = tmp_path / "celery-dlock"
    source.mkdir()
    for part in ("pyproject.toml", "README.md", "celery_dlock"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(ROOT / part, source / part)
    for line in commands(install) + commands(page["shell server"]):
        if line[0] == "pip":
            run_pip(bin_dir, line, source)
            continue
        assert line[:3] == ["python", "-m", "celery_dlock.testing"], line
        log = tmp_path / "server.log"
        with log.open("wb") as out:
            server = subprocess.Popen(line, cwd=tmp_path, env=env, stdout=out, stderr=out)
        started.append(server)
        wait_for_line(log, f"ready at redis://127.0.0.1:{port}/0", server, 30)

    # Step 2 and 4: the files.
    for what, text in page.items():
        if what.startswith("file "):
            (tmp_path / what.split(" ", 1)[1]).write_text(text)

    # Step 3: the worker, as typed (its log to a file, for reading it here).
    (worker_line,) = commands(page["shell worker"])
    assert worker_line[0] == "celery"
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [str(bin_dir / "celery"), *worker_line[1:]], cwd=tmp_path, env=env, stdout=out,
            stderr=out, start_new_session=True,
        )  # fmt: skip
    started.append(worker)
    text = wait_for_line(log, "ready.", worker, 60)
    assert f"celery_dlock: 1 singleton task(s); locks on redis://127.0.0.1:{port}/1" in text

    # Step 4: the calls, and the output the page shows.
    done = subprocess.run(
        [str(bin_dir / "python"), "try.py"], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = page["output"].strip()
    # The page's task id, host, pid and token are examples: everything else must match.
    pattern = re.escape(shown)
    for example in ("6f1d…", "myhost", "4242", "1764…"):
        pattern = pattern.replace(re.escape(example), r"\S+")
    assert re.fullmatch(pattern, done.stdout.strip()), (shown, done.stdout)

    # Step 5: the operator command, with the output the page shows.
    (check_line,) = commands(page["shell check"])
    assert check_line[:3] == ["celery", "-A", "proj"], check_line
    done = subprocess.run(
        [str(bin_dir / "celery"), *check_line[1:]], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == page["check output"].strip(), (page["check output"], done.stdout)
