"""What a lock node's name and data say: its place in line, its kind, its holder, its expiry.

A key's contenders are the children of the key's parent node. A child's name is ::

    <nonce>-<seq>                    a session node (ephemeral): lives while its session does
    <nonce>~t[~q<task>][~o<order>]-<seq>
                                     a timed node (persistent): lives for the ttl in its data

``<seq>`` is the 10 digits ZooKeeper appends to a sequential node. ``~o<order>`` marks a
*replacement*: a node created in one transaction with the deletion of the node it replaces
(a hand-over, a queued lock adopted, a forgotten lease made timed), which takes that node's
place in line. Children are ordered by their *order*: the inherited one if present, else
their own ``<seq>``. ``~q<task>`` marks a queued lock (enqueue-time mode) adoptable by the
execution of the task whose id hashes to ``<task>`` (:func:`task_hash`), so a worker sees in a
plain listing that the head is its own queued lock.

A timed node's data (JSON, like a session node's) also holds ``ttl`` (ms) and may hold
``from`` (ms on the ZooKeeper leader's clock, see :func:`expires_ms`).
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from typing import Any, NamedTuple
from urllib.parse import quote

from kazoo.protocol.states import ZnodeStat

from celery_dlock.core import forks
from celery_dlock.core.holder import Holder

#: Digits ZooKeeper appends to a sequential node's name.
SEQ_DIGITS = 10


class NodeName(NamedTuple):
    """A lock node's name, parsed."""

    name: str
    nonce: str
    seq: int
    order: int  # its place in line: the inherited order of a replacement, else seq
    timed: bool
    task: str | None  # task_hash of the task that may adopt it (a queued lock), else None

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.order, self.seq)


def key_name(key: str) -> str:
    """``key`` as one znode name (its parent node's): percent-quoted ('/' and all), never '.'
    or '..'."""
    name = quote(key, safe="")
    return name.replace(".", "%2E") if name in (".", "..") else name


def task_hash(task_id: str) -> str:
    """A task id as a short name-safe string (a queued lock's ``~q`` mark)."""
    return hashlib.sha256(task_id.encode()).hexdigest()[:20]


def prefix(
    nonce: str, *, timed: bool = False, task: str | None = None, order: int | None = None
) -> str:
    """The name of a node to create sequentially, before ZooKeeper appends its ``<seq>``."""
    flags = ""
    if timed or task is not None:
        flags += "~t"
    if task is not None:
        flags += f"~q{task_hash(task)}"
    if order is not None:
        flags += f"~o{order:0{SEQ_DIGITS}d}"
    return f"{nonce}{flags}-"


def parse_name(name: str) -> NodeName | None:
    """A child's name parsed; None for a name this module did not make."""
    digits = name[-SEQ_DIGITS:]
    if len(name) < SEQ_DIGITS + 2 or not digits.isdigit() or name[-SEQ_DIGITS - 1] != "-":
        return None
    seq = int(digits)
    nonce, *flags = name[: -SEQ_DIGITS - 1].split("~")
    order = seq
    timed = False
    task = None
    for flag in flags:
        if flag == "t":
            timed = True
        elif flag.startswith("q") and len(flag) > 1:
            task = flag[1:]
        elif flag.startswith("o") and flag[1:].isdigit():
            order = int(flag[1:])
        else:
            return None
    return NodeName(name, nonce, seq, order, timed, task)


def seq_of(path: str) -> int:
    """The sequence number ZooKeeper appended to a node's name (or path)."""
    return int(path[-SEQ_DIGITS:])


def order_of(name: str) -> int:
    """The place in line of the node ``name`` (a replacement of it inherits this)."""
    parsed = parse_name(name)
    return parsed.order if parsed is not None else int(name[-SEQ_DIGITS:])


def in_line(children: list[str]) -> list[NodeName]:
    """The children this module made, in line order (the holder first)."""
    parsed = [p for p in map(parse_name, children) if p is not None]
    return sorted(parsed, key=lambda p: p.sort_key)


def task_name(sender: Any) -> str | None:
    """The name of the task that sends a lock (a Celery task object), for a node's data."""
    name = getattr(sender, "name", None)
    return name if isinstance(name, str) else None


def identity(
    nonce: str,
    holder: str | None,
    *,
    queued: bool = False,
    task: str | None = None,
    ttl: float | None = None,
    anchor_ms: int | None = None,
) -> str:
    """The JSON a lock node holds (the same fields as a Redis lock value, fence excepted: the
    fence is known only once the node exists, see :mod:`celery_dlock.backends.zookeeper.decisions`).
    ``ttl`` makes it a timed node's data; ``anchor_ms`` its ``from`` (see :func:`expires_ms`)."""
    data: dict[str, Any] = {"token": nonce, "holder": holder}
    if queued:
        data["queued"] = True
    if task is not None:
        data["task"] = task
    data["host"] = socket.gethostname()
    data["pid"] = forks.pid()
    data["since"] = int(time.time() * 1000)
    if ttl is not None:
        data["ttl"] = ttl_ms(ttl)
        if anchor_ms is not None:
            data["from"] = anchor_ms
    return json.dumps(data, separators=(",", ":"))


def timed_data(head: str, ttl: float, anchor_ms: int | None) -> bytes:
    """A session node's data (``head``) made a timed node's, living ``ttl`` from ``anchor_ms``
    (None: from the timed node's own creation)."""
    data = json.loads(head)
    data["ttl"] = ttl_ms(ttl)
    if anchor_ms is not None:
        data["from"] = anchor_ms
    else:
        data.pop("from", None)
    return json.dumps(data, separators=(",", ":")).encode()


def ttl_ms(ttl: float) -> int:
    """A ttl in whole milliseconds, rounded up (a timed node may end late, never early)."""
    return max(1, int(-(-ttl * 1000 // 1)))


def read_holder(raw: bytes | None, stat: ZnodeStat, fence: int | None = None) -> Holder | None:
    """A lock node's data and stat as a :class:`Holder`; None if unreadable. ``fence`` is the
    holder's token, or at most it (see :mod:`celery_dlock.backends.zookeeper.decisions`); the node's
    czxid when not given."""
    try:
        data = json.loads(raw or b"")
        return Holder(
            token=str(data["token"]),
            holder=None if data.get("holder") is None else str(data["holder"]),
            host=str(data.get("host", "?")),
            pid=int(data.get("pid", 0)),
            since=float(data.get("since", 0)) / 1000.0,
            fence=int(stat.czxid) if fence is None else fence,
            queued=data.get("queued") is True,
            task=None if data.get("task") is None else str(data["task"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


def expires_ms(raw: bytes | None, stat: ZnodeStat, default_ttl: float) -> int:
    """When a timed node ends, in ms on the ZooKeeper leader's wall clock: ``from`` (or its own
    ``ctime``) plus its ``ttl``. ``ctime`` and ``mtime`` are the time the leader stamped on the
    transaction when it prepared it, so comparing them with another write's stamp measures
    time on the leader's clock (see :mod:`celery_dlock.backends.zookeeper.timed`). Unreadable data
    counts ``default_ttl`` from ``ctime``."""
    try:
        data = json.loads(raw or b"")
        ttl = int(data["ttl"])
        anchor = int(data.get("from", stat.ctime))
    except (ValueError, KeyError, TypeError):
        return int(stat.ctime) + ttl_ms(default_ttl)
    return anchor + ttl
