"""Operator reads and repairs on the Redis backend: who holds a key, every key held, a forced
release, a health check of the nodes (a purge is core.backend.BaseBackend.purge).

None of this is on a lock's path: the operator command (:mod:`celery_dlock.ops.admin`,
``celery dlock ...``), the compat layers and the worker's clean-up call these through
:class:`~.redlock.LockManager`'s methods of the same names. Every read takes what a
majority of the nodes says, as Redlock counts a lock held
(https://redis.io/docs/latest/develop/use/distributed-locks/): fewer answers raise
:class:`LockUnavailable` rather than guess "not held".
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from redis.exceptions import RedisClusterException, RedisError, ResponseError

from celery_dlock.backends.redis.decisions import ms
from celery_dlock.backends.redis.diagnose import describe, refusal
from celery_dlock.backends.redis.nodes import Node
from celery_dlock.backends.redis.transport import run_script
from celery_dlock.core.config import Settings, check_key
from celery_dlock.core.errors import LockUnavailable
from celery_dlock.core.holder import Holder, LockInfo, parse_value
from celery_dlock.core.urls import redact

log_release = logging.getLogger("celery_dlock.release")

#: The key :func:`check` reads on every node: any key will do, none is ever written there.
PROBE_KEY = "celery-dlock-check"


class RedisNodes(Protocol):
    """What these functions read of a :class:`~celery_dlock.backends.redis.redlock.LockManager`."""

    settings: Settings
    nodes: list[Node]
    quorum: int
    redlock: bool
    cluster: bool

    def redis_keys(self, key: str) -> tuple[str, str, str]: ...


def revoked_key(lock_key: str, nonce: str) -> str:
    """The marker an operator's forced release leaves for one acquisition (its nonce)."""
    return f"{lock_key}:revoked:{nonce}"


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def read_key(nodes: RedisNodes, key: str) -> list[Any]:
    """The inspect script's replies from the nodes that answered; LockUnavailable when fewer
    than a majority did."""
    keys = nodes.redis_keys(key)
    replies = run_script(nodes.nodes, "inspect", keys[:2], (), nodes.settings.node_timeout)
    answered = [r for r in replies if not isinstance(r, BaseException)]
    if len(answered) < nodes.quorum:
        errors = [
            (node.shown, describe(r, node))
            for node, r in zip(nodes.nodes, replies, strict=True)
            if isinstance(r, BaseException)
        ]
        first = "; ".join(f"{node}: {err}" for node, err in errors[:3])
        raise LockUnavailable(
            f"cannot inspect {key!r}: only {len(answered)} of {len(nodes.nodes)} node(s) "
            f"answered, {nodes.quorum} needed ({first})",
            key=key,
            errors=errors,
        )
    return answered


def _parsed(reply: Sequence[Any]) -> Holder | None:
    """The holder an inspect reply shows; None for a value this library did not write (one
    longer than the script sent back never is)."""
    value = reply[0]
    if not value or (len(reply) > 3 and int(reply[3]) > len(value)):
        return None
    return parse_value(value)


def holder_of(answered: Sequence[Any], quorum: int) -> Holder | None:
    """The acquisition a quorum of the inspect replies ``(value, pttl, fence, length)``
    shows, or None."""
    holders = [(_parsed(r), r[2]) for r in answered if r[0]]
    by_nonce = Counter(h.nonce for h, _ in holders if h is not None)
    if not by_nonce:
        return None
    nonce, count = by_nonce.most_common(1)[0]
    if count < quorum:
        return None
    mine = [(h, counter) for h, counter in holders if h and h.nonce == nonce]
    holder = max((h for h, _ in mine), key=lambda h: h.fence)
    # Each node's value carries its own proposal; the lease's token (the highest of the
    # granting nodes') was written back to their counters. When the node whose value
    # carried it does not answer, a counter still shows it.
    counters = [_counter(c) for _, c in mine]
    known = [c for c in counters if c is not None]
    if known and max(known) > holder.fence:
        holder = dataclasses.replace(holder, fence=max(known))
    return holder


def _counter(raw: Any) -> int | None:
    """A fence counter as read; None when missing or not a number (not this library's)."""
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None


#: What a value without expiry means (this library always sets one).
NO_EXPIRY = (
    "no expiry: celery_dlock always sets one, so something else wrote or persisted this "
    "value; it blocks the key until deleted"
)


def _foreign(answered: Sequence[Any], quorum: int) -> str | None:
    """A note for a value a quorum holds that this library did not write, else None."""
    found = [r for r in answered if r[0] and _parsed(r) is None]
    if len(found) < quorum:
        return None
    first = found[0]
    length = int(first[3]) if len(first) > 3 else len(first[0])
    note = (
        f"held by a value celery_dlock did not write ({length} bytes, starting "
        f"{bytes(first[0][:40])!r}); something else writes keys under dlock_prefix: delete "
        "it, or give celery_dlock a prefix of its own"
    )
    return note + (f"; {NO_EXPIRY}" if any(int(r[1]) < 0 for r in found) else "")


def holder(nodes: RedisNodes, key: str) -> Holder | None:
    """The current holder as a majority sees it, or None when no one holds ``key``."""
    key = check_key(key)
    return holder_of(read_key(nodes, key), nodes.quorum)


def inspect(nodes: RedisNodes, key: str) -> LockInfo:
    """The key's holder, time left and fencing counter, as a majority of nodes sees them."""
    key = check_key(key)
    answered = read_key(nodes, key)
    fences = [c for c in (_counter(r[2]) for r in answered) if c is not None]
    fence = max(fences) if fences else None
    found = holder_of(answered, nodes.quorum)
    if found is None:
        return LockInfo(key, None, None, fence, _foreign(answered, nodes.quorum))
    left = [int(r[1]) for r in answered if r[0] and _parsed(r) == found]
    if any(pttl < 0 for pttl in left):
        return LockInfo(key, found, None, fence, NO_EXPIRY)
    return LockInfo(key, found, min(left) / 1000.0 if left else None, fence)


def locks(nodes: RedisNodes, prefix: str = "") -> list[LockInfo]:
    """Every key starting with ``prefix`` that some node holds."""
    pattern = f"{nodes.settings.prefix}:{{{_glob_escape(prefix)}*}}"
    start = len(nodes.settings.prefix) + 2
    found: set[str] = set()
    for node in nodes.nodes:
        client = None
        try:
            client = node.endpoint.client(max(node.timeout, 1.0))  # SCAN: slower than a lock
            for raw in client.scan_iter(match=pattern, count=500):
                name = raw.decode() if isinstance(raw, bytes) else str(raw)
                found.add(name[start:-1])
        except (RedisError, RedisClusterException) as exc:
            # A down node does not stop a Redlock listing; a refusal (ACL) would hide keys.
            if not nodes.redlock or isinstance(exc, ResponseError) or refusal(exc):
                raise LockUnavailable(
                    f"cannot list locks on {node.shown}: {describe(exc, node)}",
                    key=prefix,
                    errors=[(node.shown, describe(exc, node))],
                ) from exc
        finally:
            if client is not None:
                client.close()
    return [inspect(nodes, key) for key in sorted(found)]


def force_release(nodes: RedisNodes, key: str, holder: Holder) -> bool:
    """Release ``key`` from ``holder``: leave a marker naming the acquisition, so neither its
    renewal nor a Redlock re-take can bring the key back, and move the fencing counter on.
    True if a majority released.

    A marker rather than a plain delete: a holder paused past the delete would otherwise renew
    the key back into existence (Kleppmann, "How to do distributed locking",
    https://martin.kleppmann.com/2016/02/08/how-to-do-distributed-locking.html).
    """
    key = check_key(key)
    lock_key, fence_key, signal_key = nodes.redis_keys(key)
    info = inspect(nodes, key)
    pttl = info.ttl_left or 0.0
    marker_ttl = max(2 * nodes.settings.ttl, 2 * pttl, 10.0)
    replies = run_script(
        nodes.nodes,
        "force_release",
        (lock_key, fence_key, signal_key, revoked_key(lock_key, holder.nonce)),
        (holder.nonce, ms(marker_ttl), ms(nodes.settings.fence_retention)),
        nodes.settings.node_timeout,
    )
    released = sum(1 for r in replies if r == 1)
    log_release.warning(
        "forced release of key=%s held by %s on %d of %d node(s)",
        key,
        holder.describe(),
        released,
        len(nodes.nodes),
    )
    return released >= nodes.quorum


def endpoints(nodes: RedisNodes) -> list[str]:
    """Each node's URL, passwords hidden."""
    return [redact(node.url) for node in nodes.nodes]


def check(nodes: RedisNodes) -> list[tuple[str, str | None]]:
    """``(url, error)`` per node, password hidden: whether it can run a lock script right now
    (error None) or why not."""
    probe = nodes.redis_keys(PROBE_KEY)
    replies = run_script(nodes.nodes, "inspect", probe[:2], (), nodes.settings.node_timeout)
    return [
        (redact(node.url), describe(reply, node) if isinstance(reply, BaseException) else None)
        for node, reply in zip(nodes.nodes, replies, strict=True)
    ]
