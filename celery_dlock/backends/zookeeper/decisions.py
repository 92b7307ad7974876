"""What the ZooKeeper backend concludes from replies already read: pure functions, no I/O.

A contender's next step given the key's line (:func:`admission`), whether a multi-op
transaction failed (:func:`failed`), what a server's ``srvr`` answer says (:func:`serving`),
and the fencing token (:func:`token`, below). The modules that talk to the servers act on
these; keeping them apart lets them be tested case by case without a server
(tests/unit/test_zookeeper_decisions.py).

**The fencing token**, decided from listings and stats already read.

A token is ``birth + count``: ``birth`` is the creation time of the key's parent node on the
leader's clock, in microseconds (its ``ctime`` in ms times 1000), fixed for as long as the parent
exists; ``count`` is a per-key count of the parent's child changes (creates and deletes: its
``cversion``; a sequential node's number is the ``cversion`` before its create). So tokens
are on the scale of the Redis backend's (the server clock in microseconds) and keep rising
across a switch of backend in either direction (docs/guarantees.md, "Fencing tokens").
Which count depends on whether the key ever had a *replacement* (every replacement's
transaction, :mod:`celery_dlock.backends.zookeeper.timed`, also sets the key's parent's data, so the
parent's data version, which every listing returns, says so):

- Never: the lock node's own sequence number. Without replacements line order is creation
  order, so each holder's node is younger than every earlier holder's. A waiter that was
  second in its last listing is admitted by its predecessor's deletion alone, without
  listing again (the replaced node's ``setData`` makes a replacement fire as a change, not a
  deletion), which saves a round trip on every hand-over between waiters
  (:func:`admitted_by_deletion`).
- Since a replacement: the ``cversion`` of the listing that shows the node first; for an
  adoption, the replacement node's sequence number + 1 (the count just after its create,
  the transaction's first operation). The sequence number would no longer do: a
  replacement is created later than the waiters queued behind the node it replaces, yet
  holds before them. The previous holder's count was read before its node was removed (so
  it is below the count after that removal, whichever rule gave it), and our listing shows
  that node gone (so its ``cversion`` is at least that count). Such a waiter therefore lists
  again after its predecessor's deletion too (kazoo's ``Lock`` always does). A replacement
  only ever replaces the first node in line (a holder's or a queued lock), which is what
  makes the short cut above safe up to the first replacement: a replacement of the
  predecessor fires as a change.

Strictly increasing per key either way, while the parent lives. The servers delete a key's
parent once it is empty (a container node), and the next use makes a new one, whose birth is
later than every earlier token of the key provided the key averaged fewer than one change per
microsecond over the old parent's life and the leaders' clocks did not step back (the same
condition as the Redis backend's floor). ``Holder.fence`` (``holder()``, ``celery dlock``)
shows ``birth`` + the holder's node's sequence number: its lease's token or, since a
replacement, at most that. A queued lock gets its token as any acquisition does, below the
token of the execution that adopts it. A hand-over therefore does not keep the token as
Redis does: the retry's queued lock, then its execution, each get a larger one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kazoo.protocol.states import ZnodeStat

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


# -- the fencing token -------------------------------------------------------------------------


def birth(listed: ZnodeStat | None) -> int:
    """The first part of every token of a key: its parent's creation time in µs (0 when the
    listing's stat could not be read)."""
    return int(listed.ctime) * 1000 if listed is not None else 0


def marks(listed: ZnodeStat | None, seq: int = -1) -> tuple[int, bool]:
    """What a listing of a key's parent (its stat; None when it could not be read) says for
    the token: its ``cversion`` (above ``seq``, our node's sequence number, as the listing
    came after our create), and whether the key ever had a replacement (the parent's data
    was ever set)."""
    count = max(seq + 1, int(listed.cversion) if listed is not None else 0)
    replaced = listed is not None and int(listed.version) > 0
    return count, replaced


def token(*, birth: int, replaced: bool, count: int, seq: int) -> int:
    """The token of a node the last listing shows first in line: ``birth`` + its sequence
    number while the key never had a replacement, else + that listing's ``cversion``."""
    return birth + (count if replaced else seq)


def adopted(birth: int, seq: int) -> int:
    """The token of an adoption whose replacement node has sequence number ``seq``: the
    count just after its create, above the adopted queued lock's token."""
    return birth + seq + 1


def may_skip_listing(position: int, replaced: bool) -> bool:
    """Whether the predecessor's deletion alone may admit a waiter at ``position`` (second in
    line, in a key that never had a replacement): see :func:`admitted_by_deletion`."""
    return position == 1 and not replaced


def admitted_by_deletion(
    shortcut: bool, predecessor_deleted: bool, fresh: bool, own_deleted: bool
) -> bool:
    """Whether a waiter is certainly first in line now, without listing again.

    The short cut: our listing came after our create, so it showed every node ahead of ours;
    only the predecessor was, first in line. It was deleted, not replaced (a replacement sets
    its data first: a change, not a deletion), and only the first node is ever replaced: ours
    is first now. With no replacement ever in this key, our sequence number gives our token,
    so no listing is needed, saving a round trip on every hand-over between waiters. After a
    long wait (``fresh`` False) the listing is sent anyway: its answer is the fresh proof of
    the session the lease's validity needs. Our own node deleted meanwhile rules it out too."""
    return shortcut and predecessor_deleted and fresh and not own_deleted
