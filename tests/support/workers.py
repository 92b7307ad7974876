"""Real ``celery worker`` subprocesses for the tests, and the journal their tasks write."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery_dlock.core import registry
from tests.support.clients import client

ROOT = Path(__file__).resolve().parents[2]


class Journal:
    """The events tasks recorded (``tests.support.worker_app.record``), read back by the tests."""

    def __init__(self, url: str) -> None:
        self.client = client(url)

    def clear(self) -> None:
        self.client.delete("journal")

    def entries(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.client.lrange("journal", 0, -1)]

    def select(self, event: str, **match: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in self.entries()
            if e["event"] == event and all(e.get(k) == v for k, v in match.items())
        ]

    def wait(
        self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float, what: str
    ) -> list[dict[str, Any]]:
        """Poll the journal until ``predicate(entries)``; fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            entries = self.entries()
            if predicate(entries):
                return entries
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}: {entries}")
            time.sleep(0.02)

    def wait_for(
        self, event: str, timeout: float = 15, count: int = 1, **match: Any
    ) -> list[dict[str, Any]]:
        self.wait(
            lambda es: (
                len(
                    [
                        e
                        for e in es
                        if e["event"] == event and all(e.get(k) == v for k, v in match.items())
                    ]
                )
                >= count
            ),
            timeout,
            f"{count} x {event} {match}",
        )
        return self.select(event, **match)


def intervals(entries: list[dict[str, Any]], **match: Any) -> list[tuple[float, float, str]]:
    """(start, end, task id) of every execution that ended, from start/end pairs."""
    starts = {}
    out = []
    for e in entries:
        if not all(e.get(k) == v for k, v in match.items()):
            continue
        if e["event"] == "start":
            starts[(e["id"], e.get("retries"))] = e["t"]
        elif e["event"] == "end":
            begun = starts.get((e["id"], e.get("retries")))
            if begun is not None:
                out.append((begun, e["t"], e["id"]))
    return sorted(out)


def overlaps(spans: list[tuple[float, float, str]]) -> list[tuple[str, str]]:
    return [(a[2], b[2]) for i, a in enumerate(spans) for b in spans[i + 1 :] if b[0] < a[1]]


class Worker:
    """One ``celery worker`` process (its pool children are its process group)."""

    def __init__(
        self,
        env: dict[str, str],
        journal: Journal,
        *,
        name: str,
        pool: str = "prefork",
        concurrency: int = 4,
        queue: str | None = None,
        app: str = "tests.support.worker_app",
    ) -> None:
        self.env = env
        self.app = app
        self.queue = queue
        self.journal = journal
        self.name = name
        self.pool = pool
        self.concurrency = concurrency
        self.process: subprocess.Popen[bytes] | None = None
        self.logfile = Path(tempfile.mkdtemp(prefix="dlock-worker-")) / "worker.log"

    @property
    def hostname(self) -> str:
        return f"{self.name}@dlock-test"

    def start(self, timeout: float = 30) -> Worker:
        args = [
            sys.executable, "-m", "celery", "-A", self.app, "worker",
            "-P", self.pool, "-c", str(self.concurrency), "-n", self.hostname,
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-l", "INFO", "--logfile", str(self.logfile),
            *(["-Q", self.queue] if self.queue else []),
        ]  # fmt: skip
        env = {**os.environ, **self.env, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(args, env=env, cwd=ROOT, start_new_session=True)
        try:
            self.journal.wait_for("worker_ready", timeout=timeout, hostname=self.hostname)
        except AssertionError:
            raise AssertionError(f"worker {self.name} did not start; log:\n{self.log()}") from None
        return self

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def stop(self, timeout: float = 20) -> None:
        """Warm shutdown (SIGTERM), then kill whatever is left."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout)
        self._kill_group()
        self.process = None

    def kill(self) -> None:
        """SIGKILL the worker and its pool children at once: nothing runs any cleanup."""
        self._kill_group()
        self.process = None

    def _kill_group(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


class Beat:
    """One ``celery beat`` process with its own schedule file."""

    def __init__(
        self,
        env: dict[str, str],
        *,
        name: str,
        scheduler: str | None = None,
        clock_offset: float = 0.0,
    ) -> None:
        self.env = env
        self.name = name
        self.scheduler = scheduler
        #: Seconds this beat's wall clock is ahead (behind, if negative): run under faketime.
        self.clock_offset = clock_offset
        self.directory = Path(tempfile.mkdtemp(prefix=f"dlock-beat-{name}-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def logfile(self) -> Path:
        return self.directory / "beat.log"

    def start(self) -> Beat:
        # faketime shifts the wall clock, and the monotonic one with it (consistently within the
        # process; libfaketime's DONT_FAKE_MONOTONIC breaks Python's time.sleep).
        shifted = ["faketime", "-f", f"{self.clock_offset:+g}s"] if self.clock_offset else []
        args = [
            *shifted, sys.executable, "-m", "celery", "-A", "tests.support.worker_app", "beat",
            "-s", str(self.directory / "schedule"), "--pidfile=", "-l", "INFO",
            "--logfile", str(self.logfile), "--max-interval", "1",
            *(["-S", self.scheduler] if self.scheduler else []),
        ]  # fmt: skip
        env = {**os.environ, **self.env, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(args, env=env, cwd=self.directory, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None

    def kill(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None


def use_lock_urls(app: Any, urls: list[str]) -> None:
    """Point this (test) process's copy of the app at ``urls`` and forget cached managers."""
    app.conf.dlock_urls = urls
    registry.forget(app)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
