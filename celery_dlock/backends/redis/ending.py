"""How a Redis lease ends: its release (waiting for the nodes' replies or not), its hand-over
to a retry's message, and the releases of an acquisition by its nonce or of a task's key.

Functions of the node set they act on (:class:`~.inspection.RedisNodes`, a ``LockManager``),
which calls them for the :class:`celery_dlock.core.backend.Backend` methods of the same names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from celery_dlock.backends.redis import decisions
from celery_dlock.backends.redis.decisions import ms
from celery_dlock.backends.redis.diagnose import describe
from celery_dlock.backends.redis.inspection import RedisNodes, revoked_key
from celery_dlock.backends.redis.janitor import janitor
from celery_dlock.backends.redis.nodes import Node, Reply
from celery_dlock.backends.redis.resends import Resend
from celery_dlock.backends.redis.sending import send_script
from celery_dlock.backends.redis.transport import run_script
from celery_dlock.core.config import check_key
from celery_dlock.core.errors import ConfigError
from celery_dlock.core.holder import NONCE_START, head_nonce, value_head
from celery_dlock.core.lease import Lease
from celery_dlock.core.renewal import watchdog

log_release = logging.getLogger("celery_dlock.release")


def task_name(sender: Any) -> str | None:
    """The name of the task a lease was taken for (its value names it), else None."""
    name = getattr(sender, "name", None)
    return name if isinstance(name, str) else None


def void_key(lock_key: str, head: str) -> str:
    """The marker that calls off one acquisition attempt (see scripts.VOID)."""
    return f"{lock_key}:void:{head_nonce(head)}"


def waiting_key(lock_key: str) -> str:
    """The marker a refused caller that will wait leaves, so that releases wake it (see
    scripts.RELEASE); without it a release writes no wake-up."""
    return lock_key + ":waiting"


def owner_prefix(head: str, nonce: str) -> str:
    """The start of a value that names its acquisition: ``{"token":"<nonce>"``. What a
    release compares instead of the whole head (fewer bytes, the same owner). ``nonce`` is
    ``head_nonce(head)``, which the caller has at hand."""
    return head[: NONCE_START + len(nonce) + 1]  # up to the nonce's closing quote


def release(m: RedisNodes, lease: Lease, *, wait: bool = True) -> bool:
    """Delete the lease's key on every node; True if a quorum confirmed.

    ``wait=False`` sends the release to every node without waiting for the replies (they
    are read before this thread's next command) and returns False: for the end of a task,
    where the next task should not wait on a round trip that decides nothing for it.
    """
    keys = m.redis_keys(lease.key)
    with lease.io_lock:
        lease.notice_expiry()
        if not lease.set_released():
            return False
        watchdog.discard(lease)
        until = time.monotonic() + lease.ttl  # no copy of the key lives longer than this
        silent = lease._silent if isinstance(lease, decisions.RedisLease) else None
        owed = [m.nodes[i] for i in silent] if silent else []
        failures: list[Reply] = []
        try:
            if not wait:
                head = lease.head
                ttl_ms = ms(lease.ttl)
                nonce = head_nonce(head)
                script_keys = (keys[0], keys[2], waiting_key(keys[0]))
                owner = owner_prefix(head, nonce)
                # Sent again if it may have been lost with its connection: waking a waiter
                # only if the key was still there (the first one may have landed).
                resend: Resend = ("release", script_keys, (owner, ttl_ms, "2", nonce), until)
                args = (owner, ttl_ms, "1", nonce)
                missed = send_script(m.nodes, "release", script_keys, args, resend)
                if missed:
                    owed += missed
                replies: list[Reply] = []
            else:
                replies = release_on(m, m.nodes, keys, lease.head, lease.ttl, wake=True)
                failures = [r for r in replies if isinstance(r, BaseException)]  # usually none
                if failures:
                    pairs = zip(m.nodes, replies, strict=True)
                    owed += [n for n, r in pairs if decisions.failed(r)]
            if owed:
                # Each node the release did not reach, or that may still run a stale acquire
                # or renewal of this lease, gets its delete from the janitor until it lands.
                late_keys, late_args = late_release(lease, keys)
                janitor.release(list(dict.fromkeys(owed)), late_keys, late_args, until, lease.ttl)
        except ConfigError as exc:
            # Two URLs reach one server, found only now (one address did not answer when the
            # lease was taken, so the check at acquire could not see it): the node set refuses
            # to send, and a release never raises. The renewal has reported the lease lost
            # for this reason; each copy of the key expires within its ttl.
            log_release.warning(
                "release of key=%s token=%s not sent: %s; it expires within %g s",
                lease.key,
                lease.token,
                exc,
                lease.ttl,
            )
            lease.announce_released(False if wait else None)
            return False
    confirmed = replies.count(1) >= m.quorum if wait else None
    lease.announce_released(confirmed)
    if confirmed is None:
        return False
    if failures:
        failed = [
            f"{node.shown} ({describe(r, node)})"
            for node, r in zip(m.nodes, replies, strict=True)
            if isinstance(r, BaseException)
        ]
        log_release.warning(
            "release of key=%s token=%s failed on %s; retried in the background, it "
            "expires there within %g s",
            lease.key,
            lease.token,
            ", ".join(failed),
            lease.ttl,
        )
    elif log_release.isEnabledFor(logging.DEBUG):  # what debug() asks first, one call less
        log_release.debug("released key=%s token=%s", lease.key, lease.token)
    return confirmed


def late_release(
    lease: Lease, keys: tuple[str, str, str]
) -> tuple[tuple[str, str, str, str], tuple[Any, ...]]:
    """Keys and arguments of scripts.RELEASE_LATE for ``lease``."""
    nonce = head_nonce(lease.head)
    late_keys = (keys[0], void_key(keys[0], lease.head), revoked_key(keys[0], nonce), keys[2])
    return late_keys, (lease.head, ms(lease.ttl), ms(lease.ttl), nonce)


def release_on(
    m: RedisNodes,
    nodes: Sequence[Node],
    keys: tuple[str, str, str],
    head: str,
    ttl: float,
    *,
    wake: bool,
) -> list[Reply]:
    """Run the release script on ``nodes``; ``wake`` pushes a wake-up for one waiter."""
    nonce = head_nonce(head)
    return run_script(
        nodes,
        "release",
        (keys[0], keys[2], waiting_key(keys[0])),
        (owner_prefix(head, nonce), ms(max(ttl, 0.001)), "1" if wake else "0", nonce),
        m.settings.node_timeout,
    )


def hand_over(m: RedisNodes, lease: Lease, ttl: float) -> str | None:
    """Turn ``lease`` into the queued lock of its own task's next message (a retry).

    The key keeps its fencing token and passes, without a gap, to the execution of that
    message (which takes it over). The lease itself ends here: no more renewal, no release.
    Returns the queued lock's acquisition nonce (for the message to carry) when a quorum
    confirmed; None means the lease was no longer held.
    """
    queued_head = value_head(lease.holder, queued=True, task=task_name(lease.sender))
    with lease.io_lock:
        if not lease.set_released():
            return None
        watchdog.discard(lease)
        replies = run_script(
            m.nodes,
            "handover",
            (m.redis_keys(lease.key)[0],),
            (lease.head, queued_head, lease.token, ms(ttl)),
            m.settings.node_timeout,
        )
    done = sum(1 for r in replies if r == 1)
    log_release.debug("handed key=%s over to the queued retry of %s", lease.key, lease.holder)
    return head_nonce(queued_head) if done >= m.quorum else None


def forget(lease: Lease) -> None:
    """Drop a lease this process will neither renew nor release (a queued lock, a beat
    tick key): its key lives out its ttl, or passes to whoever takes it over."""
    lease.set_released()
    watchdog.discard(lease)  # watched if someone listens for losses


def release_by_task(m: RedisNodes, key: str, task_id: str) -> bool:
    """Delete ``key`` if the task ``task_id`` holds it, whichever acquisition of it holds it.

    For operators and one-shot keys (beat's tick keys). A task id can name more than one
    execution (a redelivered copy, a retry), so releases on a task's behalf name the
    acquisition instead (:meth:`release_nonce`). True if the key was deleted on a quorum.
    The holder's next renewal then reports the lease lost.
    """
    return _release_matching(m, key, "release_holder", task_id, f"held by {task_id}")


def release_nonce(m: RedisNodes, key: str, nonce: str) -> bool:
    """Delete ``key`` if the acquisition named by ``nonce`` holds it.

    For whoever knows an acquisition has ended without releasing (the parent worker
    process of a pool process that died holding it) or will never run (a queued message
    discarded before it ran). True if the key was deleted on a quorum; a key held by any
    other acquisition, of whatever task, is left alone.
    """
    return _release_matching(m, key, "release_nonce", nonce, f"(acquisition {nonce[:6]}…)")


def _release_matching(m: RedisNodes, key: str, script: str, match: str, shown: str) -> bool:
    """Run ``script`` (a release by task id or by nonce, ``match``) on every node; True if
    the key was deleted on a quorum. ``shown`` names the holder in the log line."""
    key = check_key(key)
    keys = m.redis_keys(key)
    replies = run_script(
        m.nodes, script, (keys[0], keys[2]), (match, ms(m.settings.ttl)), m.settings.node_timeout
    )
    deleted = sum(1 for r in replies if r == 1)
    if deleted:
        log_release.info("released key=%s %s on %d node(s)", key, shown, deleted)
    return deleted >= m.quorum
