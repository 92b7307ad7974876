"""The history every execution writes, and that survives the process being killed.

Each process appends JSON lines to its own file in one directory, with ``os.write`` on an
``O_APPEND`` descriptor: a line is in the kernel's hands as soon as the call returns, so a
SIGKILL one instruction later loses nothing already written. Times are ``time.monotonic()``,
which on Linux is one clock for every process of the host, so entries from different
processes (workers, the harness) can be ordered.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_fd: dict[tuple[int, str], int] = {}  # (pid, directory) -> descriptor of this process's file


def record(directory: str | Path, event: str, **fields: Any) -> None:
    """Append one entry ``{"event": ..., "t": monotonic, "pid": ..., **fields}``."""
    pid = os.getpid()
    entry = {"event": event, "t": time.monotonic(), "pid": pid, **fields}
    line = (json.dumps(entry, default=str) + "\n").encode()
    where = (pid, str(directory))
    with _lock:
        fd = _fd.get(where)
        if fd is None:
            path = Path(directory) / f"history-{pid}.jsonl"
            fd = _fd[where] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, line)


def read(directory: str | Path) -> list[dict[str, Any]]:
    """Every entry of every process, ordered by time. A torn last line (killed mid-write) is
    skipped."""
    entries = []
    for path in Path(directory).glob("history-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue
    return sorted(entries, key=lambda e: e["t"])


class Follower:
    """Reads a history directory as it grows: each call returns only the new entries."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._offsets: dict[Path, int] = {}
        self.entries: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        new = []
        for path in self.directory.glob("history-*.jsonl"):
            offset = self._offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
            self._offsets[path] = offset + end
            for line in data[:end].splitlines():
                try:
                    new.append(json.loads(line))
                except ValueError:
                    continue
        self.entries.extend(new)
        return new
