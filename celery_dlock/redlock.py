"""Leases on one Redis or on N independent masters (Redlock), with fencing tokens.

One code path serves both: a single node is a Redlock of one with a quorum of one.

Acquire (seed 001): send the acquire script to every node at once; succeed when a majority
took the key and ``ttl - elapsed - drift`` is still positive; otherwise undo on every node at
once. Fencing: each node issues its next counter value; the token is the quorum's maximum, and
when the quorum disagreed (a node was wiped or missed acquisitions) that maximum is written
back to the quorum before the lease is handed out, so any later quorum, which shares a node
with this one, issues a larger token. That holds as long as a majority of nodes keep their data.

Waiting: a contender blocks on a signal list (``BLPOP``) that every release pushes one element
to, so a release wakes exactly one waiter, and a crashed holder's expiry bounds the wait.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from celery_dlock.config import Settings, check_key, check_renew_interval, check_seconds, quorum
from celery_dlock.errors import ConfigError, LockContended, LockUnavailable
from celery_dlock.holder import Holder, parse_value, value_head
from celery_dlock.lease import Lease, LostCallback
from celery_dlock.renewal import watchdog
from celery_dlock.transport import Node, Reply, background, blocking_pop, run_script

log_acquire = logging.getLogger("celery_dlock.acquire")
log_release = logging.getLogger("celery_dlock.release")
log_renew = logging.getLogger("celery_dlock.renew")

#: Quick re-attempts (1, 2, 4, 8, 16 ms apart) by a woken waiter that still sees the old holder.
BATON_RETRIES = 5

# Extend-script codes (see scripts.EXTEND).
_EXTENDED, _ABSENT, _RETAKEN, _TAKEN = 1, 0, 2, 3


def drift(ttl: float, factor: float) -> float:
    """Clock drift allowance: a fraction of the ttl plus 2 ms for timer granularity."""
    return ttl * factor + 0.002


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class _Refusal:
    """Why one acquisition round did not produce a lease."""

    unavailable: bool  # too few nodes answered to reach a quorum
    holder: Holder | None
    retry_after: float | None  # seconds until the holder's key expires on the nodes that said
    split: bool  # nobody holds a majority: contenders collided; back off at random
    errors: tuple[tuple[str, str], ...]
    detail: str


class LockManager:
    """Acquire, renew and release leases on the nodes of one :class:`Settings`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.nodes = [Node(url, settings.node_timeout) for url in settings.urls]
        self.quorum = quorum(len(self.nodes))
        self.redlock = len(self.nodes) > 1
        self._retention_ms = _ms(settings.fence_retention)

    def __repr__(self) -> str:
        kind = f"Redlock over {len(self.nodes)} nodes" if self.redlock else "single Redis"
        return f"<LockManager {kind}: {', '.join(n.shown for n in self.nodes)}>"

    # -- keys ------------------------------------------------------------------------------

    def redis_keys(self, key: str) -> tuple[str, str, str]:
        """The lock, fence-counter and waiter-signal keys; one hash tag, so one Cluster slot."""
        base = f"{self.settings.prefix}:{{{key}}}"
        return base, base + ":fence", base + ":signal"

    # -- acquire ---------------------------------------------------------------------------

    def acquire(
        self,
        key: str,
        *,
        ttl: float | None = None,
        wait: float | None = 0.0,
        holder: str | None = None,
        renew: bool = True,
        renew_interval: float | None = None,
        max_hold: float | None = None,
        on_lost: LostCallback | None = None,
    ) -> Lease:
        """Take ``key`` for ``ttl`` seconds, renewed in the background until released.

        ``wait=0`` raises :class:`LockContended` at once if the key is held; ``wait>0`` blocks
        up to that many seconds, woken by the holder's release; ``wait=None`` blocks without
        bound. Raises :class:`LockUnavailable` when too few nodes answer.
        """
        key = check_key(key)
        ttl = self.settings.ttl if ttl is None else check_seconds("ttl", ttl)
        interval = check_renew_interval(renew_interval, ttl) if renew else None
        if wait is not None:
            wait = check_seconds("wait", wait, allow_zero=True)
        if max_hold is not None:
            max_hold = check_seconds("max_hold", max_hold)
        if holder is not None and not isinstance(holder, str):
            raise ConfigError(f"holder must be a str (a task id) or None, not {holder!r}.")
        return self._acquire(key, ttl, wait, holder, interval, max_hold, on_lost)

    def _acquire(
        self,
        key: str,
        ttl: float,
        wait: float | None,
        holder: str | None,
        interval: float | None,
        max_hold: float | None,
        on_lost: LostCallback | None,
    ) -> Lease:
        keys = self.redis_keys(key)
        give_up = None if wait is None else time.monotonic() + wait
        woken_from: str | None = None  # token of the holder whose release woke us
        baton = 0
        while True:
            outcome = self._attempt(key, keys, ttl, holder, interval, max_hold)
            if isinstance(outcome, Lease):
                if on_lost is not None:
                    outcome.on_lost(on_lost)
                if interval is not None or max_hold is not None:
                    watchdog.add(outcome)
                log_acquire.debug("acquired key=%s token=%s", key, outcome.token)
                return outcome
            if outcome.unavailable:
                raise LockUnavailable(
                    f"cannot lock {key!r}: {outcome.detail}", key=key, errors=outcome.errors
                )
            left = None if give_up is None else give_up - time.monotonic()
            if left is not None and left <= 0:
                who = outcome.holder.describe() if outcome.holder else "another holder"
                raise LockContended(
                    f"lock {key!r} is held by {who}",
                    key=key,
                    holder=outcome.holder,
                    retry_after=outcome.retry_after,
                )
            seen = outcome.holder.token if outcome.holder else None
            if woken_from is not None and seen == woken_from and baton < BATON_RETRIES:
                # We were woken, yet some node still shows the holder that released: its
                # release has not reached every node yet. Keep the wake-up (nobody else was
                # woken) and try again shortly instead of sleeping until the next release.
                time.sleep(min(0.001 * 2**baton, left if left is not None else 1.0))
                baton += 1
                continue
            baton = 0
            woken = self._wait_for_release(keys[2], outcome, left, ttl)
            woken_from = seen if woken else None

    def _attempt(
        self,
        key: str,
        keys: tuple[str, str, str],
        ttl: float,
        holder: str | None,
        interval: float | None,
        max_hold: float | None,
    ) -> Lease | _Refusal:
        """One acquisition round on every node; a lease, or why not."""
        head = value_head(holder)
        ttl_ms = _ms(ttl)
        started = time.monotonic()
        replies = run_script(
            self.nodes,
            "acquire",
            keys[:2],
            (head, ttl_ms, self._retention_ms),
            min(self.settings.node_timeout, ttl),
        )
        fences: dict[int, int] = {}
        others: list[tuple[bytes, int]] = []
        errors: list[tuple[str, str]] = []
        for i, reply in enumerate(replies):
            if isinstance(reply, BaseException):
                errors.append((self.nodes[i].shown, _describe(reply)))
            elif reply[0] == 1:
                fences[i] = int(reply[1])
            else:
                others.append((reply[1], int(reply[2])))
        if len(fences) >= self.quorum:
            token = max(fences.values())
            if len(set(fences.values())) > 1 and not self._raise_fence(keys[1], token, fences):
                errors.append(("quorum", "could not record the fencing token on a majority"))
            else:
                deadline = started + ttl - drift(ttl, self.settings.drift_factor)
                if deadline > time.monotonic():
                    return Lease(
                        self,
                        key,
                        token,
                        head,
                        holder=holder,
                        ttl=ttl,
                        started=started,
                        deadline=deadline,
                        renew_interval=interval,
                        max_hold=max_hold,
                    )
                errors.append(("quorum", "validity ran out before the nodes answered"))
        self._undo(keys, head, ttl, fences, replies)
        return self._refusal(fences, others, errors)

    def _undo(
        self,
        keys: tuple[str, str, str],
        head: str,
        ttl: float,
        fences: dict[int, int],
        replies: list[Reply],
    ) -> None:
        """Release a failed attempt: now where we took the key, in the background where the
        node did not answer (it may have taken it all the same, and waiting on it again would
        double the time a caller waits to hear that Redis is unavailable)."""
        if fences:
            run_script(
                [self.nodes[i] for i in fences],
                "release",
                (keys[0], keys[2]),
                (head, _ms(ttl), "0"),
                self.settings.node_timeout,
            )
        silent = [self.nodes[i] for i, r in enumerate(replies) if isinstance(r, BaseException)]
        if silent:
            background(
                run_script,
                silent,
                "release",
                (keys[0], keys[2]),
                (head, _ms(ttl), "0"),
                self.settings.node_timeout,
            )

    def _refusal(
        self,
        fences: dict[int, int],
        others: list[tuple[bytes, int]],
        errors: list[tuple[str, str]],
    ) -> _Refusal:
        n = len(self.nodes)
        answered = n - len([e for e in errors if e[0] != "quorum"])
        if answered < self.quorum or (not others and errors):
            reached = f"{answered} of {n} node(s) answered, {self.quorum} needed"
            first = "; ".join(f"{node}: {err}" for node, err in errors[:3])
            return _Refusal(True, None, None, False, tuple(errors), f"{reached} ({first})")
        parsed = [(parse_value(value), pttl) for value, pttl in others]
        counts = Counter(h.token if h else None for h, _ in parsed)
        top_token, top_count = counts.most_common(1)[0]
        holder = next((h for h, _ in parsed if h and h.token == top_token), None)
        pttls = [pttl for h, pttl in parsed if (h.token if h else None) == top_token]
        retry_after = max(0, min(pttls)) / 1000.0
        return _Refusal(False, holder, retry_after, top_count < self.quorum, tuple(errors), "held")

    def _raise_fence(self, fence_key: str, token: int, fences: dict[int, int]) -> bool:
        """Write the token back to the quorum's counters; True if a majority recorded it."""
        nodes = [self.nodes[i] for i in fences]
        replies = run_script(
            nodes,
            "raise_fence",
            (fence_key,),
            (token, self._retention_ms),
            self.settings.node_timeout,
        )
        done = sum(1 for r in replies if not isinstance(r, BaseException))
        return done >= self.quorum

    def _wait_for_release(
        self, signal_key: str, refusal: _Refusal, left: float | None, ttl: float
    ) -> bool:
        """Block until a release signal (True), the holder's expiry, or the end of our wait."""
        if refusal.split:
            # Contenders collided and each holds a minority: back off at random (seed 001)
            # so one of them wins the next round.
            time.sleep(random.uniform(0.0, 0.01 + 0.002 * len(self.nodes)))
            return False
        block = ttl if refusal.retry_after is None else refusal.retry_after + 0.001
        if left is not None:
            block = min(block, left)
        if block <= 0.001:
            return False
        # All waiters block on the same node, the first that works, so that one release
        # wakes one of them; releases signal every node.
        for node in self.nodes:
            try:
                return blocking_pop(node, signal_key, block)
            except (RedisError, OSError) as exc:
                log_acquire.debug("cannot wait on %s: %s", node.shown, exc)
        return False  # no node to wait on; the next attempt will report the outage

    # -- release ---------------------------------------------------------------------------

    def release(self, lease: Lease) -> bool:
        """Delete the lease's key on every node; True if a quorum confirmed."""
        with lease.io_lock:
            if not lease.set_released():
                return False
            watchdog.discard(lease)
            replies = self._release_everywhere(
                lease.key, self.redis_keys(lease.key), lease.head, lease.ttl
            )
        deleted = sum(1 for r in replies if r == 1)
        failed = [
            self.nodes[i].shown for i, r in enumerate(replies) if isinstance(r, BaseException)
        ]
        if failed:
            log_release.warning(
                "release of key=%s token=%s did not reach %s; it expires there within %g s",
                lease.key,
                lease.token,
                ", ".join(failed),
                lease.ttl,
            )
        else:
            log_release.debug("released key=%s token=%s", lease.key, lease.token)
        return deleted >= self.quorum

    def _release_everywhere(
        self, key: str, keys: tuple[str, str, str], head: str, ttl: float
    ) -> list[Reply]:
        return run_script(
            self.nodes,
            "release",
            (keys[0], keys[2]),
            (head, _ms(ttl), "1"),
            self.settings.node_timeout,
        )

    def release_by_holder(self, key: str, holder: str) -> bool:
        """Delete ``key`` if its holder id is ``holder`` (e.g. a killed task's id).

        For the parent worker process of a task it terminated, and for operators. True if the
        key was deleted on a quorum. The holder's next renewal then reports the lease lost.
        """
        key = check_key(key)
        keys = self.redis_keys(key)
        replies = run_script(
            self.nodes,
            "release_holder",
            (keys[0], keys[2]),
            (holder, _ms(self.settings.ttl)),
            self.settings.node_timeout,
        )
        deleted = sum(1 for r in replies if r == 1)
        if deleted:
            log_release.info("released key=%s held by %s on %d node(s)", key, holder, deleted)
        return deleted >= self.quorum

    # -- inspect ---------------------------------------------------------------------------

    def holder(self, key: str) -> Holder | None:
        """The current holder as a majority sees it, or None when no one holds ``key``."""
        keys = self.redis_keys(check_key(key))
        replies = run_script(self.nodes, "inspect", keys[:2], (), self.settings.node_timeout)
        values = [r[0] for r in replies if not isinstance(r, BaseException) and r[0]]
        if not values:
            return None
        value, count = Counter(values).most_common(1)[0]
        if count < self.quorum:
            return None
        return parse_value(value)

    # -- renew (called by the watchdog) ----------------------------------------------------

    def renew(self, leases: Sequence[Lease]) -> list[str | None]:
        """Extend every lease in one script call per node.

        Returns, per lease, ``None`` when renewed or undecided (nodes did not answer; the
        watchdog retries until the lease's validity runs out), or the reason it is lost.
        """
        keys: list[str] = []
        args: list[Any] = ["1" if self.redlock else "0", self._retention_ms]
        for lease in leases:
            lock_key, fence_key, _ = self.redis_keys(lease.key)
            keys += (lock_key, fence_key)
            args += (lease.head, _ms(lease.ttl), lease.token)
        started = time.monotonic()
        timeout = max(0.001, min(self.settings.node_timeout, *(x.valid_for for x in leases)))
        replies = run_script(self.nodes, "extend", keys, args, timeout)
        failed = [r for r in replies if isinstance(r, BaseException)]
        if failed:
            log_renew.warning(
                "renewal: %d of %d node(s) did not answer: %s",
                len(failed),
                len(self.nodes),
                _describe(failed[0]),
            )
        out: list[str | None] = []
        for j, lease in enumerate(leases):
            codes = [None if isinstance(r, BaseException) else int(r[j]) for r in replies]
            extended = codes.count(_EXTENDED)
            if extended >= self.quorum:
                lease.renewed(
                    started, started + lease.ttl - drift(lease.ttl, self.settings.drift_factor)
                )
                out.append(None)
            elif extended + codes.count(None) >= self.quorum:
                out.append(None)  # might still hold; retry before the validity runs out
            else:
                out.append(self._loss_reason(codes))
        return out

    def _loss_reason(self, codes: list[int | None]) -> str:
        taken = codes.count(_TAKEN)
        gone = codes.count(_ABSENT) + codes.count(_RETAKEN)
        where = "" if not self.redlock else f" on {taken + gone} of {len(codes)} nodes"
        if taken and taken >= gone:
            return f"another holder has the key{where}"
        return (
            f"the key is gone from Redis{where} (deleted, expired, or Redis restarted "
            "without its data)"
        )

    def close(self) -> None:
        for node in self.nodes:
            node.close()
