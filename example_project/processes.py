"""The processes the demo starts: Celery workers and beat, each in its own process group.

A process group per worker means one ``killpg`` reaches the worker and its pool children, as a
crashed host would, and the demo can clean up everything it started, also on Ctrl-C; a session
of its own keeps a terminal's Ctrl-C from reaching them before the demo stops them in order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from example_project import stopping

ROOT = Path(__file__).resolve().parent.parent
APP = "example_project.celery_app"


class Process:
    def __init__(self, name: str, args: list[str], env: dict[str, str], logfile: Path) -> None:
        self.name = name
        self.args = args
        self.env = env
        self.logfile = logfile
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was not started"
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> Process:
        """Spawn it, unless the demo is asked to stop; the caller has registered ``stop``."""
        stopping.check()
        env = {**os.environ, **self.env, "PYTHONPATH": str(ROOT)}
        self.popen = self._spawn(env)
        stopping.pause_point(f"spawn {self.name}")
        return self

    def _spawn(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", APP, *self.args, "--logfile", str(self.logfile)],
            env=env, cwd=self.logfile.parent, start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def log(self, lines: int = 30) -> str:
        if not self.logfile.exists():
            return ""
        return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL whatever of the group is left."""
        stopping.pause_point(f"stop {self.name}")
        if self.popen is None:
            return
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGCONT)  # a paused child must hear it
            self.popen.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=timeout)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole group at once: no cleanup runs, as when a host dies."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)


def worker(name: str, env: dict[str, str], directory: Path, concurrency: int = 2) -> Process:
    args = [
        "worker", "-P", "prefork", "-c", str(concurrency), "-n", f"{name}@%h",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
    ]  # fmt: skip
    return Process(name, args, env, directory / f"{name}.log")


def beat(name: str, env: dict[str, str], directory: Path) -> Process:
    args = ["beat", "-s", str(directory / f"{name}-schedule"), "--pidfile=", "-l", "WARNING"]
    return Process(name, args, env, directory / f"{name}.log")


def wait_until(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> None:
    """Poll ``predicate()`` until true; raise TimeoutError naming ``what`` after ``timeout``.

    A stop signal ends the wait with :class:`~example_project.stopping.Interrupted`.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        stopping.sleep(interval)
