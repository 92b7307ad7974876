"""The fencing token of a ZooKeeper lease: which zxid it is, decided from listings and stats
already read (pure functions, no I/O).

The token is a zxid, the id ZooKeeper's leader gives each write (epoch in the high 32 bits, a
counter in the low 32); every server applies writes in zxid order, so zxids strictly increase
across the whole ensemble, through leader changes (a new leader starts a higher epoch)
(https://zookeeper.apache.org/doc/current/zookeeperInternals.html#sc_guaranteesPropertiesDefinitions).
Which zxid depends on whether the key ever had a *replacement* (every replacement's
transaction, :mod:`celery_dlock.zookeeper.timed`, also sets the key's parent's data, so the
parent's data version, which every listing returns, says so):

- Never: the lock node's ``czxid``. Without replacements line order is creation order, so
  each holder's node is younger than every earlier holder's. A waiter that was second in
  its last listing is admitted by its predecessor's deletion alone, without listing again
  (the replaced node's ``setData`` makes a replacement fire as a change, not a deletion),
  which saves a round trip on every hand-over between waiters (:func:`admitted_by_deletion`).
- Since a replacement: the ``pzxid`` (zxid of the last change to the parent's children) of
  the listing that shows the node first; for an adoption, its transaction's zxid. The
  ``czxid`` would no longer do: a replacement is created later than the waiters queued
  behind the node it replaces, yet holds before them. The previous holder's token was
  read before its node was removed (so it is below the zxid of that removal, whichever
  rule gave it), and our listing shows that node gone (so its pzxid is at least that zxid).
  Such a waiter therefore lists again after its predecessor's deletion too (kazoo's
  ``Lock`` always does). A replacement only ever replaces the first node in line (a
  holder's or a queued lock), which is what makes the short cut above safe up to the
  first replacement: a replacement of the predecessor fires as a change.

Strictly increasing per key either way. The key's parent forgets (its data version back
to 0) only when the servers delete it empty, after every earlier holder is gone.
``Holder.fence`` (``holder()``, ``celery dlock``) shows the holder's node's ``czxid``: its
lease's token or, since a replacement, at most that. A queued lock gets its token as any
acquisition does (a hand-over's: the transaction's zxid), below the token of the
execution that adopts it. A hand-over therefore does not keep the token as Redis does: the
retry's queued lock, then its execution, each get a larger one, which keeps the promise.
Tokens do not survive wiping the ensemble's data.
"""

from __future__ import annotations

from kazoo.protocol.states import ZnodeStat


def marks(listed: ZnodeStat | None, czxid: int = 0) -> tuple[int, bool]:
    """What a listing of a key's parent (its stat; None when it could not be read) says for
    the token: its ``pzxid`` (at least ``czxid``, our node's, which the listing shows), and
    whether the key ever had a replacement (the parent's data was ever set)."""
    pzxid = max(czxid, int(listed.pzxid) if listed is not None else 0)
    replaced = listed is not None and int(listed.version) > 0
    return pzxid, replaced


def token(*, replaced: bool, pzxid: int, czxid: int) -> int:
    """The token of a node the last listing shows first in line: its ``czxid`` while the key
    never had a replacement, else that listing's ``pzxid``."""
    return pzxid if replaced else czxid


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
    is first now. With no replacement ever in this key, our czxid is our token, so no listing
    is needed, saving a round trip on every hand-over between waiters. After a long wait
    (``fresh`` False) the listing is sent anyway: its answer is the fresh proof of the session
    the lease's validity needs. Our own node deleted meanwhile rules it out too."""
    return shortcut and predecessor_deleted and fresh and not own_deleted
