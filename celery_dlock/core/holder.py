"""What a lock's value says about its holder, and how it is written; who holds a key.

The value stored under a lock key is one line of JSON (on Redis, ``redis-cli GET`` shows it)::

    {"token":"Yk3…","holder":"5f0c…-task-id","host":"worker-1","pid":4242,"since":1763773730123,"fence":1763773730124}

* ``token`` — the acquisition's nonce (:attr:`Holder.nonce`): 20 random bytes (``secrets``),
  unique to this acquisition. Release and renewal compare the whole value, so only this
  acquisition can extend or delete it. (The JSON names stay as they are: values written by
  every version must stay readable.)
* ``holder`` — who holds it for release-by-holder (:attr:`Holder.task_id`): the Celery task
  id, or ``null``.
* ``queued`` — present (``true``) while an enqueued message holds the key (enqueue-time mode).
* ``task`` — present when a task holds it: the task's name, for the operator command.
* ``host``, ``pid``, ``since`` (wall-clock milliseconds, for display only), and ``fence`` —
  the fencing token, which the acquire script appends (the client sends everything before it).

:class:`LockInfo` is a key as the operator sees it: its holder, time left and fencing counter.
Both are backend-neutral: a backend other than Redis fills them from its own records.
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
from json.encoder import encode_basestring_ascii
from typing import Any

from celery_dlock.core import forks

NONCE_BYTES = 20


@dataclass(frozen=True)
class Holder:
    """The parsed value of a held lock, for errors, logs and the operator command.

    Read the acquisition's random id as :attr:`nonce` and the holding task's id as
    :attr:`task_id`. The fields themselves keep their first names, ``token`` and ``holder``
    (what the lock value's JSON calls them): pickles, ``dataclasses.replace`` and ``asdict``
    made by any version stay readable by every other.
    """

    #: The random id of this acquisition (:attr:`nonce`): release and renewal match it, so
    #: only this acquisition can extend or delete the key. Not the fencing token (:attr:`fence`).
    token: str
    #: The id of the task holding the key (:attr:`task_id`), or None outside a task.
    holder: str | None
    host: str
    pid: int
    since: float  # wall-clock seconds; display only, never used for validity
    fence: int
    queued: bool = False  # held by an enqueued message, not yet by a running execution
    task: str | None = None  # the task's name, when a task holds it

    @property
    def nonce(self) -> str:
        """The acquisition's random id, which release and renewal match (field ``token``)."""
        return self.token

    @property
    def task_id(self) -> str | None:
        """The id of the task holding the key, or None outside a task (field ``holder``)."""
        return self.holder

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain values (how an error carries its holder through a result backend)."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        who = f"task {self.task_id}" if self.task_id else "a process"
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


class _Nonces:
    """Random acquisition nonces from ``secrets``, drawn 64 at a time.

    Each ``os.urandom`` call is a system call, a noticeable part of a lock cycle; one draw of
    64 nonces' worth costs about the same as one nonce (benchmarks/README.md, "Figures behind
    the code's constants"). Every nonce is still 20 fresh
    random bytes, used once; the stock is dropped after fork, so a child never repeats its
    parent's nonces.
    """

    BATCH = 64

    def __init__(self) -> None:
        self._pid = -1
        self._stock: list[str] = []
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:
            if self._pid != forks.pid() or not self._stock:
                raw = secrets.token_bytes(NONCE_BYTES * self.BATCH)
                self._stock = [
                    base64.urlsafe_b64encode(raw[i : i + NONCE_BYTES]).rstrip(b"=").decode()
                    for i in range(0, len(raw), NONCE_BYTES)
                ]
                self._pid = forks.pid()
            return self._stock.pop()


_nonces = _Nonces()


def value_head(task_id: str | None, *, queued: bool = False, task: str | None = None) -> str:
    """Everything of a new value up to the fencing token, with a fresh random nonce.

    ``task_id`` is the holder id to write (or None). The acquire script appends ``<fence>}``; the
    full value is ``head + str(fence) + "}"``. ``queued`` marks the lock an enqueued message
    holds until its execution takes it over.
    """
    nonce = _nonces.next()
    # A str (every caller's) is written as json.dumps would, without its set-up per call.
    who = (
        "null"
        if task_id is None
        else encode_basestring_ascii(task_id)
        if type(task_id) is str
        else json.dumps(task_id)
    )
    since = int(time.time() * 1000)
    mark = ',"queued":true' if queued else ""
    if task is not None:
        mark += _task_part(task)
    return f'{{"token":"{nonce}","holder":{who}{mark}{_process_part.get()},"since":{since},"fence":'


@functools.lru_cache(maxsize=1024)
def _task_part(task: str) -> str:
    """The task name's part of a value: one per task, so computed once."""
    return f',"task":{json.dumps(task)}'


#: Where a value's nonce starts (after ``{"token":"``), and where the quote after a nonce
#: drawn by :class:`_Nonces` stands (``NONCE_BYTES`` in unpadded base64: 27 characters).
NONCE_START = len('{"token":"')
_NONCE_END = NONCE_START + len(base64.urlsafe_b64encode(bytes(NONCE_BYTES)).rstrip(b"="))


def head_nonce(head: str) -> str:
    """The acquisition's random nonce inside a value head (it always opens the value)."""
    # A nonce drawn here has a known length: check the quote after it rather than search for
    # it (str.index parses its arguments, which costs more than the search; this runs once
    # per acquire and once per release). The same answer for any head: its first quote.
    nonce = head[NONCE_START:_NONCE_END]
    if head[_NONCE_END : _NONCE_END + 1] == '"' and '"' not in nonce:
        return nonce
    return head[NONCE_START : head.index('"', NONCE_START)]


@dataclass(frozen=True)
class LockInfo:
    """One key as a majority of nodes sees it (``celery_dlock.ops.admin``, the operator command)."""

    key: str
    holder: Holder | None  # None when nobody holds the key
    ttl_left: float | None  # seconds until the key expires, None when not held
    fence: int | None  # the key's fencing counter (the last token handed out); None: none yet
    #: What else the store shows that this library did not write: a value it cannot read
    #: (the key is blocked all the same), or a value without expiry. None when all is its own.
    note: str | None = None

    @property
    def held(self) -> bool:
        return self.holder is not None

    @property
    def task_id(self) -> str | None:
        """The id of the task holding the key (None when free, or held outside a task)."""
        return self.holder.task_id if self.holder is not None else None

    @property
    def state(self) -> str | None:
        """``"queued"``: a published message's lock (enqueue-time mode), which no execution
        holds yet; ``"running"``: a task's execution holds it; ``"held"``: a holder outside a
        task (``lock()``, beat); None when free."""
        if self.holder is None:
            return None
        if self.holder.queued:
            return "queued"
        return "running" if self.holder.task_id else "held"

    def as_dict(self, now: float | None = None) -> dict[str, Any]:
        """The fields the operator command prints; ``now`` (wall seconds) dates ``age``."""
        holder = self.holder
        now = time.time() if now is None else now
        return {
            "key": self.key,
            "held": holder is not None,
            "state": self.state,
            "task": holder.task if holder else None,
            "task_id": holder.task_id if holder else None,
            "host": holder.host if holder else None,
            "pid": holder.pid if holder else None,
            "queued": holder.queued if holder else None,
            "age": round(now - holder.since, 3) if holder else None,
            "ttl_left": None if self.ttl_left is None else round(self.ttl_left, 3),
            "fence": holder.fence if holder else self.fence,
        } | ({"note": self.note} if self.note is not None else {})


# Pickled under the module that first defined it (see celery_dlock/redlock.py), so that a
# process of any version loads what another pickled.
LockInfo.__module__ = "celery_dlock.redlock"
# Pickled under the module that defined it before ``core/`` existed (now a re-export).
Holder.__module__ = "celery_dlock.holder"
