"""What the ZooKeeper backend concludes from replies already read: pure functions, no I/O.

A contender's next step given the key's line (:func:`admission`), whether a multi-op
transaction failed (:func:`failed`), what a server's ``srvr`` answer says (:func:`serving`).
The modules that talk to the servers act on these; keeping them apart lets them be tested
case by case without a server (tests/test_zookeeper_decisions.py). The fencing token's rules
are in :mod:`celery_dlock.backends.zookeeper.fencing`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from celery_dlock.backends.zookeeper.nodes import NodeName

#: Steps of :func:`admission`.
WON, GONE, ADOPT, REFUSE, WAIT = "won", "gone", "adopt", "refuse", "wait"


class Step(NamedTuple):
    """A contender's next step, and the node it concerns."""

    kind: str  # WON, GONE, ADOPT, REFUSE or WAIT
    position: int  # our node's place in line (-1 when it is not in line)
    node: NodeName | None  # ADOPT/REFUSE: the first node in line; WAIT: the one before ours


def admission(
    line: Sequence[NodeName], name: str, adoptable: str | None, out_of_time: bool
) -> Step:
    """Our next step, given the key's children in line order and our node's ``name``:

    * WON: our node is first in line;
    * GONE: our node is not in line (our session expired, or an operator deleted it);
    * ADOPT: the first node is the queued lock of our own task (its ``~q`` mark equals
      ``adoptable``, the :func:`~celery_dlock.backends.zookeeper.nodes.task_hash` of the task id we
      take over), whatever our time left;
    * REFUSE: our ``wait`` ran out (``out_of_time``) behind someone else's node;
    * WAIT: watch the node just ahead of ours.
    """
    names = [n.name for n in line]
    if name not in names:
        return Step(GONE, -1, None)
    position = names.index(name)
    if position == 0:
        return Step(WON, 0, None)
    head = line[0]
    if adoptable is not None and head.task == adoptable:
        return Step(ADOPT, position, head)
    if out_of_time:
        return Step(REFUSE, position, head)
    return Step(WAIT, position, line[position - 1])


def failed(results: Sequence[Any]) -> BaseException | None:
    """The error of a multi-op transaction's results (kazoo returns them, not raises)."""
    for result in results:
        if isinstance(result, BaseException):
            return result
    return None


def serving(answer: bytes) -> str | None:
    """What a server's answer to ``srvr`` says: None when it serves clients (the answer has
    its ``Mode:``), else the answer's first line (or "no answer")."""
    text = answer.decode(errors="replace")
    if "Mode:" in text:
        return None
    return text.strip().splitlines()[0] if text.strip() else "no answer"
