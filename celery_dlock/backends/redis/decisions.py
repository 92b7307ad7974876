"""What the Redis backend concludes from its nodes' replies: pure functions, no I/O.

Each takes replies already read (or their codes) and the quorum, and returns a decision: who
holds a key that refused us, why a lease is lost, whether a renewal kept it, which nodes may
still run a command late. :class:`~celery_dlock.backends.redis.redlock.LockManager` does the talking
and acts on these; keeping them apart lets them be tested case by case without a Redis.

The quorum rule is Redlock's (https://redis.io/docs/latest/develop/use/distributed-locks/): a
lease exists only while a majority of the nodes holds its value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from redis.exceptions import ResponseError

from celery_dlock.backends.redis.nodes import Reply
from celery_dlock.backends.redis.transport import unsent
from celery_dlock.core.holder import Holder, parse_value
from celery_dlock.core.lease import Lease

# Extend-script codes (see scripts.EXTEND).
EXTENDED, ABSENT, RETAKEN, TAKEN, REVOKED = 1, 0, 2, 3, 4


class RedisLease(Lease):
    """A lease of the Redis backend, which also records where a command for it went unanswered."""

    #: Indices of the nodes that did not answer the acquire or a renewal of this lease and may
    #: still run it late (stalled, not dead), so the release owes them a void; None while every
    #: node answered. A class default: set on the instance only when a node was silent.
    _silent: frozenset[int] | None = None


class Identity(NamedTuple):
    """A lock value found on a node, and the three ways to tell which acquisition wrote it."""

    holder: Holder | None  # the parsed value; None for a value this library did not write
    nonce: str | None  # the acquisition's random nonce
    task_id: str | None  # the task holding it (one task's queued lock and execution share it)
    raw: bytes | None  # the value itself, for a value this library did not write


def identity(value: bytes, length: int | None = None) -> Identity:
    """A lock value parsed, with what identifies its holder. ``length`` is the value's whole
    length when the script sent only its start: such a value is never this library's."""
    holder = None if length is not None and length > len(value) else parse_value(value)
    if holder is None:
        return Identity(None, None, None, value)
    return Identity(holder, holder.nonce, holder.task_id, None)


#: The ways of grouping the values that refused us, in the order they are tried: the same
#: acquisition, then the same task (an enqueue-time lock being taken over by its execution
#: shows two acquisitions of one task for a moment), then the same foreign value.
_GROUPINGS: tuple[Callable[[Identity], Any], ...] = (
    lambda i: i.nonce,
    lambda i: i.task_id,
    lambda i: i.raw,
)


@dataclass(frozen=True)
class Refusal:
    """Why one acquisition round did not produce a lease."""

    unavailable: bool  # too few nodes answered to reach a quorum
    holder: Holder | None
    retry_after: float | None  # seconds until the holder's key expires on the nodes that said
    split: bool  # nobody holds a majority: contenders collided; back off at random
    errors: tuple[tuple[str, str], ...]
    detail: str
    answered: tuple[int, ...] = ()  # indices of the nodes that answered
    #: The holding value when this library did not write it: its start, and its length.
    foreign: tuple[bytes, int] | None = None
    #: The holding value has no expiry (this library always sets one): something else wrote
    #: or persisted it, and it stays until deleted.
    no_expiry: bool = False


def refusal(
    others: Sequence[tuple[bytes, int, int]],
    errors: Sequence[tuple[str, str]],
    answered: tuple[int, ...],
    nodes: int,
    quorum: int,
) -> Refusal:
    """Why an attempt that took the key on fewer than ``quorum`` of ``nodes`` failed.

    ``others`` are ``(value, pttl, length)`` of the nodes where someone else's value was found,
    ``errors`` ``(node, error)`` of the nodes that gave no usable answer, ``answered`` the
    indices of the nodes that answered.
    """
    if len(answered) < quorum or (not others and errors):
        reached = f"{len(answered)} of {nodes} node(s) answered, {quorum} needed"
        first = "; ".join(f"{node}: {err}" for node, err in errors[:3])
        return Refusal(True, None, None, False, tuple(errors), f"{reached} ({first})", answered)
    # Values of one acquisition differ between nodes only in the fence counter each node
    # appended, so the highest fence among them is the real token. Without a majority nobody
    # holds the key: the values are contenders' partial attempts, about to be undone (a split).
    found = [(identity(value, length), pttl, length) for value, pttl, length in others]
    for key_of in _GROUPINGS:
        groups: dict[Any, list[tuple[Identity, int, int]]] = {}
        for ident, pttl, length in found:
            group = key_of(ident)
            if group is not None:
                groups.setdefault(group, []).append((ident, pttl, length))
        top = next((g for g in groups.values() if len(g) >= quorum), None)
        if top is not None:
            holders = [i.holder for i, _, _ in top if i.holder is not None]
            holder = max(holders, key=lambda h: h.fence) if holders else None
            foreign = None
            if holder is None:
                ident, _, length = top[0]
                foreign = (ident.raw or b"", length)
            # PTTL -1: no expiry. Waiting for it would spin (nothing ever expires), so no
            # retry_after: a waiter sleeps its ttl between tries, woken by a release.
            no_expiry = any(pttl < 0 for _, pttl, _ in top)
            retry_after = None if no_expiry else min(pttl for _, pttl, _ in top) / 1000.0
            return Refusal(
                False, holder, retry_after, False, tuple(errors), "held", answered, foreign,
                no_expiry,
            )  # fmt: skip
    return Refusal(False, None, None, True, tuple(errors), "contended", answered)


class Tally(NamedTuple):
    """The acquire script's replies, sorted by what each node said."""

    fences: dict[int, int]  # node index -> the fencing token it issued, where it took the key
    others: list[tuple[bytes, int, int]]  # (value, pttl, length) where another holds the key
    errors: list[int]  # node indices without a usable answer, in node order


def tally(replies: Sequence[Reply]) -> Tally:
    """Sort acquire replies: ``{1, fence}`` took the key, ``{0, value, pttl}`` held by another,
    an exception or ``{2}`` (voided) no usable answer."""
    fences: dict[int, int] = {}
    others: list[tuple[bytes, int, int]] = []
    errors: list[int] = []
    for i, reply in enumerate(replies):
        if isinstance(reply, BaseException):
            errors.append(i)
        elif reply[0] == 1:
            fences[i] = int(reply[1])
        elif reply[0] == 0:
            value = reply[1]
            length = int(reply[3]) if len(reply) > 3 else len(value)
            others.append((value, int(reply[2]), length))
        else:  # voided ({2}), or a fence counter that cannot issue a token ({3})
            errors.append(i)
    return Tally(fences, others, errors)


class Renewal(NamedTuple):
    """What one lease's renewal codes (one per node, None where no answer) decide."""

    renewed: bool  # a quorum extended it: its validity starts again
    lost: str | None  # why it is lost; None while it may still hold (then retried)


def renewal(codes: Sequence[int | None], quorum: int, redlock: bool) -> Renewal:
    """Renewed when a quorum extended the key; undecided while the nodes that did not answer
    could still make a quorum; lost otherwise. A re-take (code 2) never counts toward the
    quorum, so re-taking vanished copies cannot manufacture a majority."""
    extended = codes.count(EXTENDED)
    if extended >= quorum:
        return Renewal(True, None)
    if extended + codes.count(None) >= quorum:
        return Renewal(False, None)
    return Renewal(False, loss_reason(codes, redlock))


def loss_reason(codes: Sequence[int | None], redlock: bool) -> str:
    """Why a lease whose renewal did not reach a quorum is lost, from the extend codes."""
    if codes.count(REVOKED):
        return "released by an operator (celery dlock release)"
    taken = codes.count(TAKEN)
    gone = codes.count(ABSENT) + codes.count(RETAKEN)
    where = "" if not redlock else f" on {taken + gone} of {len(codes)} nodes"
    if taken and taken >= gone:
        return f"another holder has the key{where}"
    return (
        f"the key is gone from Redis{where} (deleted, expired, or Redis restarted without its data)"
    )


def silent(replies: Sequence[Reply]) -> frozenset[int]:
    """Nodes that were sent a command and did not answer: they may still run it."""
    return frozenset(
        i for i, r in enumerate(replies) if isinstance(r, BaseException) and not unsent(r)
    )


def failed(reply: Reply) -> bool:
    """A release reply that is no answer (an error reply is an answer: retrying cannot help)."""
    return isinstance(reply, BaseException) and not isinstance(reply, ResponseError)


def ms(seconds: float) -> int:
    """Seconds as the whole milliseconds a script takes; never 0 (PX 0 is an error)."""
    return max(1, round(seconds * 1000))
