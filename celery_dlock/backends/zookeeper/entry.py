"""Joining a key's line: our node's create and the listing of its parent, sent back to back
(one round trip), then read; a missing parent is made, a lost create's reply found again by
nonce. The line itself is :mod:`celery_dlock.backends.zookeeper.line`."""

from __future__ import annotations

import secrets
import time
from functools import partial
from typing import Any, NamedTuple

from kazoo.exceptions import ConnectionLoss, NoNodeError
from kazoo.protocol.states import ZnodeStat

from celery_dlock.backends.zookeeper.decisions import birth, marks
from celery_dlock.backends.zookeeper.keyspace import Keyspace
from celery_dlock.backends.zookeeper.loss import Guard
from celery_dlock.backends.zookeeper.nodes import identity, seq_of, task_name
from celery_dlock.backends.zookeeper.nodes import prefix as node_prefix
from celery_dlock.backends.zookeeper.znodes import find, make_parent
from celery_dlock.core.errors import LockUnavailable


class Attempt:
    """One acquisition under way: its node's create and the parent's listing, sent together
    and not yet read (so :meth:`ZooKeeperBackend.send_queued` can return before the replies)."""

    def __init__(
        self,
        space: Keyspace,
        key: str,
        ttl: float,
        holder: str | None,
        *,
        timed: bool,
        queued: bool,
        sender: Any,
    ) -> None:
        self.session, self.client = space.client()
        self.key = key
        self.ttl = ttl
        self.holder = holder
        self.timed = timed
        self.queued = queued
        self.sender = sender
        self.nonce = secrets.token_urlsafe(15)
        self.parent = space.parent(key)
        self.data = identity(
            self.nonce,
            holder,
            queued=queued,
            task=task_name(sender),
            ttl=ttl if timed else None,
        ).encode()
        self.name_prefix = node_prefix(self.nonce, timed=timed, task=holder if queued else None)
        self.guard = Guard(self.client, self.session)
        self.begun = time.monotonic()
        self.created: Any = None
        self.listing: Any = None
        self.send()

    def again(self, space: Keyspace) -> Attempt:
        """A fresh attempt with the same arguments (a new nonce, a new node)."""
        return Attempt(
            space,
            self.key,
            self.ttl,
            self.holder,
            timed=self.timed,
            queued=self.queued,
            sender=self.sender,
        )

    def send(self) -> None:
        """Send our node's create and the parent's listing, back to back."""
        self.created = self.client.create_async(
            f"{self.parent}/{self.name_prefix}",
            self.data,
            acl=self.session.acl,
            ephemeral=not self.timed,
            sequence=True,
            include_data=True,
        )
        self.listing = self.client.get_children_async(
            self.parent, watch=self.guard.on_children, include_data=True
        )


class Entered(NamedTuple):
    """Our node, and the listing of its parent sent right after its create."""

    path: str
    stat: ZnodeStat
    received: float  # when the create's reply arrived (its ctime is the leader's "now")
    children: list[str]
    changes: int  # the parent's cversion in that listing: its child changes so far
    replaced: bool  # the parent's data was ever set: a replacement happened in this key
    birth: int  # the parent's creation time in µs: the first part of every token


def enter(space: Keyspace, attempt: Attempt) -> Entered:
    """Our node and the parent's listing (one round trip, see
    :mod:`celery_dlock.backends.zookeeper.line`). A missing parent (a key's first use, or its
    container removed) is created, and the create sent again."""
    client, session, parent = attempt.client, attempt.session, attempt.parent
    timeout = session.op_timeout
    for _ in range(10):
        try:
            path, stat = attempt.created.get(timeout=timeout)
        except NoNodeError:
            make_parent(client, session, parent, space.base)
            attempt.send()
            continue
        except ConnectionLoss:
            # The create may have happened without its reply reaching us: find it by nonce.
            found = find(client, session, parent, attempt.nonce)
            if found is None:
                raise
            path, stat = found
            attempt.listing = client.get_children_async(
                parent, watch=attempt.guard.on_children, include_data=True
            )
        received = time.monotonic()
        try:
            children, listed = attempt.listing.get(timeout=timeout)
        except (NoNodeError, ConnectionLoss):  # listed before the parent was made, or lost
            children, listed = [], None
        if path.rsplit("/", 1)[1] not in children:
            watched = partial(
                client.get_children_async,
                parent,
                watch=attempt.guard.on_children,
                include_data=True,
            )
            children, listed = session.call(watched)
        count, replaced = marks(listed, seq_of(path))
        return Entered(path, stat, received, list(children), count, replaced, birth(listed))
    raise LockUnavailable(
        f"cannot lock {attempt.key!r}: its parent node {parent} keeps vanishing",
        key=attempt.key,
    )
