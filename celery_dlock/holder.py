"""What a lock's value says about its holder, and how it is written.

The value stored under a lock key is one line of JSON, readable with ``redis-cli GET``::

    {"token":"Yk3…","holder":"5f0c…-task-id","host":"worker-1","pid":4242,"since":1763773730123,"fence":1763773730124}

* ``token`` — 20 random bytes (``secrets``), unique to this acquisition. Release and renewal
  compare the whole value, so only this acquisition can extend or delete it.
* ``holder`` — who holds it for release-by-holder: the Celery task id, or ``null``.
* ``queued`` — present (``true``) while an enqueued message holds the key (enqueue-time mode).
* ``task`` — present when a task holds it: the task's name, for the operator command.
* ``host``, ``pid``, ``since`` (wall-clock milliseconds, for display only), and ``fence`` —
  the fencing token, which the acquire script appends (the client sends everything before it).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from celery_dlock import forks

TOKEN_BYTES = 20


@dataclass(frozen=True)
class Holder:
    """The parsed value of a held lock, for errors, logs and the operator command."""

    token: str
    holder: str | None
    host: str
    pid: int
    since: float  # wall-clock seconds; display only, never used for validity
    fence: int
    queued: bool = False  # held by an enqueued message, not yet by a running execution
    task: str | None = None  # the task's name, when a task holds it

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain values (how an error carries its holder through a result backend)."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        who = f"task {self.holder}" if self.holder else "a process"
        if self.queued:
            return f"{who}, queued by {self.host} (pid {self.pid}, fencing token {self.fence})"
        return f"{who} on {self.host} (pid {self.pid}, fencing token {self.fence})"


def parse_value(raw: bytes | str | None) -> Holder | None:
    """Read a lock value; ``None`` for a missing key or a value this library did not write."""
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        return Holder(
            token=str(data["token"]),
            holder=None if data.get("holder") is None else str(data["holder"]),
            host=str(data.get("host", "?")),
            pid=int(data.get("pid", 0)),
            since=float(data.get("since", 0)) / 1000.0,
            fence=int(data["fence"]),
            queued=data.get("queued") is True,
            task=None if data.get("task") is None else str(data["task"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


class _ProcessPart:
    """The host and pid part of every value, computed once per process (and again after fork)."""

    def __init__(self) -> None:
        self.pid = -1
        self.text = ""

    def get(self) -> str:
        pid = forks.pid()
        if pid != self.pid:
            self.text = f',"host":{json.dumps(socket.gethostname())},"pid":{pid}'
            self.pid = pid
        return self.text


_process_part = _ProcessPart()


class _Tokens:
    """Random tokens from ``secrets``, drawn 64 at a time.

    Each ``os.urandom`` call is a system call (about 12 µs on a small VM, a tenth of a lock
    cycle); one draw of 64 tokens' worth costs about the same. Every token is still 20 fresh
    random bytes, used once; the stock is dropped after fork, so a child never repeats its
    parent's tokens.
    """

    BATCH = 64

    def __init__(self) -> None:
        self._pid = -1
        self._stock: list[str] = []
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:
            if self._pid != forks.pid() or not self._stock:
                raw = secrets.token_bytes(TOKEN_BYTES * self.BATCH)
                self._stock = [
                    base64.urlsafe_b64encode(raw[i : i + TOKEN_BYTES]).rstrip(b"=").decode()
                    for i in range(0, len(raw), TOKEN_BYTES)
                ]
                self._pid = forks.pid()
            return self._stock.pop()


_tokens = _Tokens()


def value_head(holder: str | None, *, queued: bool = False, task: str | None = None) -> str:
    """Everything of a new value up to the fencing token, with a fresh random token.

    The acquire script appends ``<fence>}``; the full value is ``head + str(fence) + "}"``.
    ``queued`` marks the lock an enqueued message holds until its execution takes it over.
    """
    token = _tokens.next()
    who = "null" if holder is None else json.dumps(holder)
    since = int(time.time() * 1000)
    mark = ',"queued":true' if queued else ""
    if task is not None:
        mark += _task_part(task)
    return f'{{"token":"{token}","holder":{who}{mark}{_process_part.get()},"since":{since},"fence":'


@functools.lru_cache(maxsize=1024)
def _task_part(task: str) -> str:
    """The task name's part of a value: one per task, so computed once."""
    return f',"task":{json.dumps(task)}'


def head_token(head: str) -> str:
    """The random token inside a value head (it always opens the value)."""
    start = len('{"token":"')
    return head[start : head.index('"', start)]
