"""The Redis backend: leases on one Redis or on N independent masters (Redlock), with fencing
tokens. :class:`LockManager` implements :class:`celery_dlock.core.backend.Backend`.

One code path serves both: a single node is a Redlock of one with a quorum of one.

Acquire (Redlock, https://redis.io/docs/latest/develop/use/distributed-locks/): send the acquire
script to every node at once; succeed when a majority took the key and ``ttl - elapsed - drift``
is still positive; otherwise undo on every node.

Fencing: each node issues its next counter value; the token is the maximum over the nodes that
took the key, and when they disagreed (a node was wiped or missed acquisitions) that maximum is
written back to them before the lease is handed out. Every later quorum shares a node with
them, so it issues a larger token unless every shared node lost its counter; counters that go
missing restart at the node's clock in microseconds, which is ahead of earlier tokens unless
the key averaged more than about one acquisition per microsecond. On a single Redis every token is
floored at the server clock (see :data:`scripts.ACQUIRE`).

Waiting: a contender blocks on a signal list (``BLPOP``) that every release pushes one element
to, so a release wakes exactly one waiter, and a crashed holder's expiry bounds the wait.

What the replies decide is in :mod:`.decisions` (pure); how a lease ends (release, hand-over)
in :mod:`.ending`; renewal in :mod:`.renewing`; the operator's reads and repairs in
:mod:`.inspection`. This module acquires, waits, and is the :class:`Backend` they share.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from redis.exceptions import RedisError, ResponseError

from celery_dlock.backends.redis import decisions, ending, inspection, nodes, renewing
from celery_dlock.backends.redis.cluster import node_for
from celery_dlock.backends.redis.decisions import RedisLease, Refusal, ms
from celery_dlock.backends.redis.diagnose import describe
from celery_dlock.backends.redis.ending import void_key, waiting_key
from celery_dlock.backends.redis.janitor import LATE_LIMIT, janitor
from celery_dlock.backends.redis.nodes import Identities, Node, Reply
from celery_dlock.backends.redis.owed import Deferred
from celery_dlock.backends.redis.scripts import MARKER_BLOCKS, MAX_TOKEN
from celery_dlock.backends.redis.sending import send_deferred
from celery_dlock.backends.redis.transport import blocking_pop, run_script, time_left
from celery_dlock.core.backend import LOOK_AGAIN, Again, BaseBackend, TaskResults, look_again
from celery_dlock.core.clock import jitter, real_clock
from celery_dlock.core.config import (
    Settings,
    drift,
    quorum,
)
from celery_dlock.core.errors import ConfigError, LockContended, LockUnavailable
from celery_dlock.core.holder import Holder, LockInfo, head_nonce, value_head
from celery_dlock.core.lease import Lease, LostCallback
from celery_dlock.core.renewal import announce_won, watchdog

log_acquire = logging.getLogger("celery_dlock.acquire")
log_release = logging.getLogger("celery_dlock.release")
log_renew = logging.getLogger("celery_dlock.renew")

#: Extra attempts when contenders collided with nobody holding a majority (Redlock).
SPLIT_RETRIES = 5
#: Quick re-attempts (1, 2, 4, ... ms apart) by a woken waiter that still sees the holder whose
#: release woke it, while that release reaches the other nodes.
BATON_RETRIES = 8
#: Most attempts this process undid that it remembers (:meth:`LockManager._own_leftover`).
UNDONE_KEPT = 1000
#: A waiter blocks again after a bare look only if the waiter marker outlasts that block by
#: this many seconds (a pause of the waiter's process between look and block is covered up
#: to it); otherwise it looks with a full attempt, which sets the marker again.
MARKER_SLACK = 1.0


class _Request(NamedTuple):
    """What one acquire call asks for, checked (a tuple: made on every acquire)."""

    key: str
    ttl: float
    holder: str | None
    interval: float | None  # renewal interval; None = not renewed
    max_hold: float | None
    takeover: str  # task id whose queued lock may be taken over, or ""
    queued: bool
    sender: Any
    retention_ms: int | None = None  # how long the fence counter is kept; None = the setting
    waits: bool = False  # a refusal will be waited on (it leaves the waiter marker)
    #: The most ms the waiter marker should last beyond one block (scripts.ACQUIRE's ARGV[6]):
    #: the wait itself, bounded; 0 on Redlock, whose waiters look again by a full attempt.
    marker_extra_ms: int = 0


class LockManager(BaseBackend):
    """Acquire, renew and release leases on the nodes of one :class:`Settings`."""

    #: A lock expires ttl after its last renewal; a forced release is seen at the next one.
    expires = True
    release_seen_at_once = False
    keeps_free_fence = True

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.nodes: list[Node] = [
            node_for(url, settings.node_timeout, settings.prefix) for url in settings.urls
        ]
        self.quorum = quorum(len(self.nodes))
        self.redlock = len(self.nodes) > 1
        if self.redlock:  # refuse two URLs of one server at first contact (run_id)
            identities = Identities(self.nodes)
            for node in self.nodes:
                node.group = identities
        #: A Redis Cluster (always the only node): one script call may touch only one slot.
        self.cluster = any(node.cluster for node in self.nodes)
        self._retention_ms = ms(settings.fence_retention)
        #: The acquire script's "floor the token at the server clock" flag (single Redis).
        self._floor = "0" if self.redlock else "1"
        #: How long a Redlock attempt that others read on a majority may still be undone by
        #: its acquirer (Backend.settle_time): the replies' timeout, a fence write-back and
        #: the undo, one node timeout each. One node: a value there is a decided acquisition.
        self.settle_time = 3 * settings.node_timeout if self.redlock else 0.0
        #: Attempts this process undid (nonce -> head, and when its copies expire): where an
        #: undo or void did not land yet, such an attempt can still be found holding a
        #: majority, and it holds for nobody (:meth:`_own_leftover`).
        self._undone: dict[str, tuple[str, float]] = {}

    def __repr__(self) -> str:
        kind = f"Redlock over {len(self.nodes)} nodes" if self.redlock else "single Redis"
        kind = "Redis Cluster" if self.cluster else kind
        return f"<LockManager {kind}: {', '.join(n.shown for n in self.nodes)}>"

    # -- keys ------------------------------------------------------------------------------

    def redis_keys(self, key: str) -> tuple[str, str, str]:
        """The lock, fence-counter and waiter-signal keys; one hash tag, so one Cluster slot."""
        base = f"{self.settings.prefix}:{{{key}}}"
        return base, base + ":fence", base + ":signal"

    # -- acquire ---------------------------------------------------------------------------

    def acquire_checked(
        self,
        key: str,
        ttl: float,
        wait: float | None,
        *,
        holder: str | None,
        interval: float | None,
        max_hold: float | None = None,
        on_lost: LostCallback | None = None,
        takeover: str | None = None,
        queued: bool = False,
        sender: Any = None,
        fence_retention: float | None = None,
    ) -> Lease:
        """:meth:`acquire` for arguments already checked (a task checks its options once)."""
        retention = None if fence_retention is None else ms(fence_retention)
        waits = wait is None or wait > 0
        # A single node's waiter looks again between blocks with a bare PTTL, so its marker
        # should last several blocks, but not past the wait itself.
        extra = 0 if self.redlock or not waits else MAX_TOKEN if wait is None else ms(wait)
        request = _Request(
            key, ttl, holder, interval, max_hold, takeover or "", queued, sender, retention, waits,
            extra,
        )  # fmt: skip
        if self.cluster and key.startswith("}"):
            raise ConfigError(
                f"lock key {key!r} starts with '}}': on Redis Cluster that empties the "
                "{hash tag} that keeps a lock's keys in one slot; put any other character first."
            )
        keys = self.redis_keys(key)
        begun = time.monotonic()
        outcome = self._attempt(request, keys)
        if isinstance(outcome, Lease):  # the usual case: no loop to set up
            return announce_won(outcome, begun, on_lost)
        return self._retry(request, keys, begun, wait, on_lost, outcome)

    def _retry(
        self,
        request: _Request,
        keys: tuple[str, str, str],
        begun: float,
        wait: float | None,
        on_lost: LostCallback | None,
        outcome: Refusal,
    ) -> Lease:
        """:meth:`acquire_checked` after a first attempt that did not take the key (``outcome``)."""
        key = request.key
        ttl = request.ttl
        give_up = None if wait is None else begun + wait
        # The same length of real time bounds the wait too: a test's frozen time.monotonic()
        # (freezegun) would otherwise never let it end.
        real_end = None if wait is None else real_clock() + wait
        woken_from: str | None = None  # nonce of the holder whose release woke us, if any
        baton = 0
        splits = 0
        # When the refused attempt was sent, on the real clock (it bounds the marker's end).
        sent = real_clock() - (time.monotonic() - begun)

        def remaining() -> float | None:
            if give_up is None or real_end is None:
                return None
            return min(give_up - time.monotonic(), real_end - real_clock())

        while True:
            if outcome.unavailable:
                raise self._refused(key, outcome)
            if outcome.split and splits < SPLIT_RETRIES:
                # Contenders collided and nobody holds a majority: not "held" yet, so even a
                # caller that will not wait gets a few more tries, at random delays, as Redlock
                # retries a split vote (https://redis.io/docs/latest/develop/use/distributed-locks/).
                splits += 1
                time.sleep(jitter(0.0, 0.005 * splits))
            else:
                left = None
                if give_up is not None and real_end is not None:
                    left = min(give_up - time.monotonic(), real_end - real_clock())
                if left is not None and left <= 0:
                    raise self._refused(key, outcome)
                seen = outcome.holder.nonce if outcome.holder else None
                if woken_from is not None and seen == woken_from and baton < BATON_RETRIES:
                    # The release that woke us has not reached every node yet. We hold the
                    # only wake-up it gave: try again shortly rather than sleep, or it would
                    # be lost.
                    time.sleep(min(0.001 * 2**baton, left if left is not None else 1.0))
                    baton += 1
                else:
                    baton = 0
                    until = None if left is None else time.monotonic() + left
                    marker = self._marker_until(request, outcome, sent)
                    woken_from = self._wait_for_release(
                        key, keys, outcome, until, ttl, marker, remaining
                    )
            sent = real_clock()
            attempt = self._attempt(request, keys)
            if isinstance(attempt, Lease):
                return announce_won(attempt, begun, on_lost)
            outcome = attempt

    @staticmethod
    def _refused(key: str, outcome: Refusal) -> LockContended | LockUnavailable:
        """The error for an attempt that will not be tried again."""
        if outcome.unavailable:
            return LockUnavailable(
                f"cannot lock {key!r}: {outcome.detail}", key=key, errors=outcome.errors
            )
        who = outcome.holder.describe() if outcome.holder else "contenders (no majority)"
        if outcome.foreign is not None:
            start, length = outcome.foreign
            who = (
                f"a value celery_dlock did not write ({length} bytes, starting "
                f"{start[:40]!r}); something else writes keys under dlock_prefix: delete it, "
                "or give celery_dlock a prefix of its own"
            )
        if outcome.no_expiry:
            who += (
                ", with no expiry: celery_dlock always sets one, so something else wrote or "
                "persisted this value, and it stays until deleted (celery dlock release KEY, "
                "or DEL)"
            )
        return LockContended(
            f"lock {key!r} is held by {who}",
            key=key,
            holder=outcome.holder,
            retry_after=outcome.retry_after,
        )

    def _head(self, request: _Request) -> str:
        return value_head(
            request.holder, queued=request.queued, task=ending.task_name(request.sender)
        )

    def _acquire_args(self, request: _Request, keys: tuple[str, str, str], head: str) -> Any:
        script_keys = (keys[0], keys[1], void_key(keys[0], head))
        args = (
            head,
            ms(request.ttl),
            request.retention_ms or self._retention_ms,
            request.takeover,
            self._floor,
        )
        if request.waits:  # only a caller that will wait leaves the waiter marker
            return (*script_keys, waiting_key(keys[0])), (*args, request.marker_extra_ms)
        return script_keys, args

    def _attempt(self, request: _Request, keys: tuple[str, str, str]) -> Lease | Refusal:
        """One acquisition round on every node; a lease, or why not."""
        head = self._head(request)
        started = time.monotonic()
        script_keys, args = self._acquire_args(request, keys, head)
        try:
            replies = run_script(
                self.nodes,
                "acquire",
                script_keys,
                args,
                min(self.settings.node_timeout, request.ttl),
            )
        except ConfigError:
            raise  # refused on contact (two URLs reach one server), before anything was sent
        except BaseException:
            # Interrupted mid-call (a soft time limit, say): nodes may have taken the key.
            self._void(list(self.nodes), keys, head, started + request.ttl)
            raise
        return self._outcome(request, keys, head, started, replies)

    def _void(self, nodes: list[Node], keys: tuple[str, str, str], head: str, until: float) -> None:
        # Remembered here, where a copy may be left (a silent node, a release lost), not for
        # every refused attempt: a storm of those would push the ones that matter out.
        self._note_undone(head, until)
        janitor.void(nodes, keys[0], void_key(keys[0], head), head, until)

    def _note_undone(self, head: str, until: float) -> None:
        """Remember that the attempt ``head``, whose copies last until ``until`` (monotonic),
        was undone by this process."""
        undone = self._undone
        if len(undone) >= UNDONE_KEPT:
            # Kept as long as the janitor voids it: a node that stalled may still run it late.
            gone = time.monotonic() - LATE_LIMIT
            kept = {n: v for n, v in list(undone.items()) if v[1] > gone}
            self._undone = undone = kept if len(kept) < UNDONE_KEPT else {}
        undone[head_nonce(head)] = (head, until)

    def _own_leftover(self, keys: tuple[str, str, str], refused: Refusal, ttl: float) -> Refusal:
        """``refused``, unless the holder it names is an attempt this process undid whose
        undo has not landed on a majority yet (a release or void still owed, a node that ran
        it late): nobody holds the key by it. Merging into its task id, or waiting for its
        release, would wait on a holder that does not exist: it is voided on every node at
        once, and the refusal counts as contenders colliding (try again shortly)."""
        found = refused.holder
        undone = self._undone.get(found.nonce) if found is not None else None
        if undone is None:
            return refused
        head = undone[0]
        log_acquire.info(
            "key=%s: an attempt of this process that was undone still held a majority; "
            "voiding it now",
            keys[0],
        )
        run_script(
            self.nodes,
            "void",
            (keys[0], void_key(keys[0], head)),
            (head, ms(max(ttl, undone[1] - time.monotonic()))),  # the marker outlives it
            self.settings.node_timeout,
        )
        return dataclasses.replace(
            refused, holder=None, retry_after=None, split=True, detail="contended"
        )

    def send_queued(
        self, key: str, ttl: float, *, holder: str, sender: Any = None
    ) -> PendingAcquire | None:
        """Send a queued lock's acquisition (enqueue-time mode) without waiting for the reply.

        The caller does its own work meanwhile, then calls :meth:`PendingAcquire.finish`. Only
        for one plain Redis node (None otherwise: use :meth:`acquire`). Arguments must be
        checked already, as a task's options are.
        """
        if self.redlock or self.cluster:
            return None
        request = _Request(key, ttl, holder, None, None, "", True, sender)  # no take-over
        keys = self.redis_keys(key)
        head = self._head(request)
        started = time.monotonic()
        script_keys, args = self._acquire_args(request, keys, head)
        deferred = send_deferred(self.nodes[0], "acquire", script_keys, args)
        return PendingAcquire(self, request, keys, head, started, deferred)

    def _outcome(
        self,
        request: _Request,
        keys: tuple[str, str, str],
        head: str,
        started: float,
        replies: list[Reply],
    ) -> Lease | Refusal:
        ttl = request.ttl
        if len(replies) == 1:
            # One node that took the key (the usual case): the lease, unless its validity ran
            # out meanwhile (then the general path below undoes the attempt).
            reply = replies[0]
            if not isinstance(reply, BaseException) and reply[0] == 1:
                deadline = started + ttl - drift(ttl, self.settings.drift_factor)
                if deadline > time.monotonic():
                    return RedisLease(
                        self,
                        request.key,
                        int(reply[1]),
                        head,
                        holder=request.holder,
                        ttl=ttl,
                        started=started,
                        deadline=deadline,
                        renew_interval=request.interval,
                        max_hold=request.max_hold,
                        sender=request.sender,
                    )
        fences, others, failures = decisions.tally(replies)
        errors = [(self.nodes[i].shown, self._failure(replies[i], i, keys)) for i in failures]
        if len(fences) >= self.quorum:
            token = max(fences.values())
            retention = request.retention_ms or self._retention_ms
            if len(set(fences.values())) > 1 and not self._raise_fence(
                keys[1], token, fences, retention
            ):
                errors.append(("quorum", "could not record the fencing token on a majority"))
            else:
                deadline = started + ttl - drift(ttl, self.settings.drift_factor)
                if deadline > time.monotonic():
                    lease = RedisLease(
                        self,
                        request.key,
                        token,
                        head,
                        holder=request.holder,
                        ttl=ttl,
                        started=started,
                        deadline=deadline,
                        renew_interval=request.interval,
                        max_hold=request.max_hold,
                        sender=request.sender,
                    )
                    if errors:
                        # A node that got the acquire and did not answer may still run it
                        # (stalled, not dead): the release owes it a void (see release()).
                        lease._silent = decisions.silent(replies)
                    return lease
                errors.append(("quorum", "validity ran out before the nodes answered"))
        self._undo(keys, head, ttl, fences, replies)
        # Nodes that refused first: a waiter blocks on the first, and only a refusal left the
        # waiter marker there that makes a release wake it (scripts.RELEASE). A node whose fence
        # counter is out of range (code 3) did not answer the question of who holds the key.
        answered = tuple(
            sorted(
                (
                    i
                    for i, r in enumerate(replies)
                    if not isinstance(r, BaseException) and r[0] != 3
                ),
                key=lambda i: replies[i][0] != 0,
            )
        )
        refused = decisions.refusal(others, errors, answered, len(self.nodes), self.quorum)
        return self._own_leftover(keys, refused, ttl) if self._undone else refused

    def _failure(self, reply: Reply, i: int, keys: tuple[str, str, str]) -> str:
        """What a node's acquire reply without a usable answer says."""
        if isinstance(reply, BaseException):
            return describe(reply, self.nodes[i])
        if reply[0] == 3:
            return (
                f"its fencing counter {keys[1]} holds {reply[1]!r}, not a count below "
                f"{MAX_TOKEN} (2**53 - 1) as celery_dlock writes: the next token would not "
                "rise, or not be exact, so none is issued. Something else wrote it; set it to "
                "a number below that (tokens then rise from it) once no holder of an older "
                "token can still write"
            )
        return "attempt voided"

    def _undo(
        self,
        keys: tuple[str, str, str],
        head: str,
        ttl: float,
        fences: dict[int, int],
        replies: list[Reply],
    ) -> None:
        """Release a failed attempt: now where we took the key, in the background where the
        node did not answer (it may take the key yet, and waiting on it again would double
        the time a caller waits to hear that Redis is unavailable)."""
        late = [self.nodes[i] for i in decisions.silent(replies)]
        if fences:
            taken = [self.nodes[i] for i in fences]
            undone = ending.release_on(self, taken, keys, head, ttl, wake=False)
            late += [n for n, r in zip(taken, undone, strict=True) if isinstance(r, BaseException)]
        if late:
            self._void(late, keys, head, time.monotonic() + ttl)

    def _raise_fence(
        self, fence_key: str, token: int, fences: dict[int, int], retention_ms: int
    ) -> bool:
        """Write the token back to the quorum's counters, kept ``retention_ms`` as the
        acquisition asked; True if a majority recorded it.

        Only to the nodes whose counter is below it: the others issued it, so they hold it."""
        nodes = [self.nodes[i] for i, fence in fences.items() if fence < token]
        replies = run_script(
            nodes,
            "raise_fence",
            (fence_key,),
            (token, retention_ms),
            self.settings.node_timeout,
        )
        done = sum(1 for r in replies if not isinstance(r, BaseException))
        return len(fences) - len(nodes) + done >= self.quorum

    @staticmethod
    def _marker_until(request: _Request, refusal: Refusal, sent: float) -> float | None:
        """When (real clock) the waiter marker ``refusal`` left ends at the earliest, for a
        waiter that may look again with a bare PTTL; None when it must look by a full attempt
        (Redlock, a holder without expiry). The same sum as scripts.ACQUIRE, counted from when
        the attempt was sent: the server set it later."""
        if not request.marker_extra_ms or refusal.retry_after is None:
            return None
        block = max(ms(refusal.retry_after), ms(request.ttl))
        extra = min(block * (MARKER_BLOCKS - 1), request.marker_extra_ms)
        return sent + (block + extra + 1000) / 1000

    def _wait_for_release(
        self,
        key: str,
        keys: tuple[str, str, str],
        refusal: Refusal,
        give_up: float | None,
        ttl: float,
        marker_until: float | None = None,
        remaining: Callable[[], float | None] = lambda: None,
    ) -> str | None:
        """Block until a release signal, the holder's expiry, or the end of our wait.

        Returns the nonce of the holder whose release woke us, or None (timeout, collision).
        With ``marker_until`` (one node), a block that times out while the holder still has
        time left is followed by another, after a bare ``PTTL`` (:meth:`_look_again`), as long
        as the waiter marker lasts; then None, and the caller's full attempt sets it again.
        """
        signal_key = keys[2]
        if refusal.split:
            # Contenders collided and each holds a minority: back off at random, as Redlock
            # does, so one of them wins the next round.
            time.sleep(jitter(0.0, 0.01 + 0.002 * len(self.nodes)))
            return None
        expiry = ttl if refusal.retry_after is None else refusal.retry_after + 0.001
        until = (
            time.monotonic() + expiry
            if give_up is None
            else min(give_up, time.monotonic() + expiry)
        )
        # All waiters block on the same node, so that one release wakes one of them:
        # the first node that refused the last attempt (releases signal every node).
        order = list(refusal.answered) + [
            i for i in range(len(self.nodes)) if i not in refusal.answered
        ]
        refused: list[tuple[str, str]] = []
        for i in order:
            node = self.nodes[i]
            while True:
                block = until - time.monotonic()
                if block <= 0.001:
                    return None
                try:
                    popped = blocking_pop(node, signal_key, block)
                except ResponseError as exc:
                    # The node answered but will not let us wait (an ACL user without BLPOP):
                    # trying again at once would only spin.
                    refused.append((node.shown, describe(exc, node)))
                    break
                except (RedisError, OSError) as exc:
                    log_acquire.debug("cannot wait on %s: %s", node.shown, exc)
                    break
                if popped is not None:
                    return popped.decode(errors="replace")
                later = self._look_again(node, keys[0], marker_until, remaining, block)
                if later is None:
                    return None
                until = later
        if refused:
            first = "; ".join(f"{shown}: {err}" for shown, err in refused[:3])
            raise LockUnavailable(f"cannot wait for {key!r}: {first}", key=key, errors=refused)
        return None  # no node to wait on; the next attempt will report the outage

    @staticmethod
    def _look_again(
        node: Node,
        lock_key: str,
        marker_until: float | None,
        remaining: Callable[[], float | None],
        last: float,
    ) -> float | None:
        """After a block (of ``last`` seconds) that timed out: when (monotonic) to block until
        next, if the holder's key still has time left by a bare ``PTTL`` and the waiter marker
        outlasts that block by MARKER_SLACK; else None, for a full attempt (the key is gone or
        has no expiry, the marker must be set again, the node did not answer, the wait is
        over)."""
        if marker_until is None:
            return None
        left = remaining()
        if left is not None and left <= 0.001:
            return None
        if real_clock() + min(last, left or last) + MARKER_SLACK > marker_until:
            # A block like the last would outlast the marker: no PTTL that would only say so.
            return None
        try:
            left_ms = time_left(node, lock_key)
        except (RedisError, OSError) as exc:
            log_acquire.debug("cannot look at %s on %s: %s", lock_key, node.shown, exc)
            return None
        if left_ms <= 0:
            return None
        block = left_ms / 1000 + 0.001
        if left is not None:
            block = min(block, left)
        if real_clock() + block + MARKER_SLACK > marker_until:
            return None
        return time.monotonic() + block

    # -- release ---------------------------------------------------------------------------

    def duplicate_of(
        self, key: str, refusal: LockContended, looks: dict[str, int], results: TaskResults
    ) -> Holder | Literal[Again.LOOK] | None:
        """See :meth:`celery_dlock.core.backend.Backend.duplicate_of`. On Redlock, contenders
        that collided with nobody holding a majority are looked at again (one of them soon
        will hold it), and a queued holder is merged into only once :meth:`confirm_holder`
        says it can no longer be undone."""
        holder = refusal.holder
        if holder is None and refusal.retry_after is None:
            why = f"no majority of the lock nodes agrees on a holder of {key!r}"
            return look_again(looks, "splits", why)
        if holder is None or holder.task_id is None or not holder.queued:
            return holder
        # The holder's attempt may yet be undone (it missed a reply), and its task id then
        # never published. Merge only into one confirmed.
        if (
            self.settle_time
            and results.kept()
            and not self.confirm_holder(key, holder, results.ran)
        ):
            looks["confirms"] = looks.get("confirms", 0) + 1
            if looks["confirms"] < CONFIRM_TRIES:
                return LOOK_AGAIN
            raise LockUnavailable(
                f"the holders of {key!r} kept changing before they settled", key=key
            )
        return holder

    def confirm_holder(self, key: str, holder: Holder, ran: Callable[[str | None], bool]) -> bool:
        """Whether a duplicate may merge into ``holder``, a queued lock just read from ``key``.

        On Redlock an attempt that took a majority can miss a reply, see none, and undo itself
        within :attr:`settle_time` of writing its value, and its task id is then never
        published. True at once where ``settle_time`` is 0 or ``holder`` is older than it;
        otherwise read ``key`` until the holder can no longer be undone: True once its task
        holds the key, executing or settled, or has run (``ran(task_id)``: its result state
        left PENDING); False when it let the key go without running (its attempt was undone:
        look again), or a newer attempt of its task holds it, not settled yet. Raises
        :class:`LockUnavailable` without a quorum."""
        # On the holder's wall clock, but never more than settle_time from now (clocks differ).
        if time.time() - holder.since >= self.settle_time:
            return True
        until = min(holder.since, time.time()) + self.settle_time
        gone_until: float | None = None
        while True:
            now = self.holder(key)
            mine = now if now is not None and now.task_id == holder.task_id else None
            if mine is not None and not mine.queued:  # its execution holds the key: published
                return True
            # Its state left PENDING: it ran. Also when its key is queued again (a run handed it
            # over to its retry's message, a value written just then, so not settled either).
            if ran(holder.task_id):
                return True
            if mine is not None:
                if mine.nonce != holder.nonce:  # the same task, another attempt: confirm that one
                    return False
                if time.time() >= until:
                    return True
                # Still the same queued acquisition, not settled yet: its acquirer may undo it.
                wait_until = until
            else:
                # Gone, or another task's, or no majority for one value (a read in the middle of
                # the worker's take-over). The key is read again too, so an execution seen
                # holding it confirms at once, not when its run ends (a task's state stays
                # PENDING while it runs unless it tracks STARTED).
                if gone_until is None:
                    gone_until = max(until, time.time() + self.settle_time)
                if time.time() >= gone_until:
                    return False
                wait_until = gone_until
            time.sleep(max(0.0, min(CONFIRM_POLL, wait_until - time.time())))

    def release(self, lease: Lease, *, wait: bool = True) -> bool:
        """Delete the lease's key on every node; True if a quorum confirmed.

        ``wait=False`` sends the release to every node without waiting for the replies (they
        are read before this thread's next command) and returns False: for the end of a task,
        where the next task should not wait on a round trip that decides nothing for it.
        """
        return ending.release(self, lease, wait=wait)

    def hand_over(self, lease: Lease, ttl: float) -> str | None:
        """Turn ``lease`` into the queued lock of its own task's next message (a retry): the
        queued lock's nonce when a quorum confirmed, None when the lease was no longer held."""
        return ending.hand_over(self, lease, ttl)

    def forget(self, lease: Lease) -> None:
        """Drop a lease this process will neither renew nor release (a queued lock, a beat
        tick key): its key lives out its ttl, or passes to whoever takes it over."""
        ending.forget(lease)

    def release_by_task(self, key: str, task_id: str) -> bool:
        """Delete ``key`` if the task ``task_id`` holds it, whichever acquisition (operators,
        one-shot keys); True if deleted on a quorum. See :func:`.ending.release_by_task`."""
        return ending.release_by_task(self, key, task_id)

    def release_nonce(self, key: str, nonce: str) -> bool:
        """Delete ``key`` if the acquisition named by ``nonce`` holds it; True if deleted on a
        quorum. See :func:`.ending.release_nonce`."""
        return ending.release_nonce(self, key, nonce)

    # -- inspect and repair (the operator's; see celery_dlock.backends.redis.inspection)
    # ------------------

    def holder(self, key: str) -> Holder | None:
        """The current holder as a majority sees it, or None when no one holds ``key``.

        Raises :class:`LockUnavailable` when fewer than a majority answer: "not held" would
        then be a guess.
        """
        return inspection.holder(self, key)

    def inspect(self, key: str) -> LockInfo:
        """The key's holder, time left and fencing counter, as a majority of nodes sees them."""
        return inspection.inspect(self, key)

    def locks(self, prefix: str = "") -> list[LockInfo]:
        """Every key starting with ``prefix`` that some node holds (for the operator command)."""
        return inspection.locks(self, prefix)

    def force_release(self, key: str, holder: Holder) -> bool:
        """Release ``key`` from ``holder`` for an operator: its renewal will report it lost.

        Leaves a marker naming the acquisition, so neither its renewal nor a Redlock re-take
        can bring the key back, and moves the fencing counter on. True if a majority released.
        """
        return inspection.force_release(self, key, holder)

    def endpoints(self) -> list[str]:
        """Each node's URL, passwords hidden."""
        return inspection.endpoints(self)

    def describe(self) -> str:
        """The node, or Redlock and its nodes."""
        urls = self.endpoints()
        return urls[0] if len(urls) == 1 else f"Redlock over {len(urls)} nodes: {', '.join(urls)}"

    def line(self, key: str) -> list[Holder]:
        """Empty: a waiter blocks on the key's signal list and leaves nothing behind."""
        return []

    def check(self) -> list[tuple[str, str | None]]:
        """``(url, error)`` per node: error None where a lock script ran, else why not."""
        return inspection.check(self)

    # -- renew (called by the watchdog) ----------------------------------------------------

    def renew(self, leases: Sequence[Lease]) -> list[str | None]:
        """Extend every lease; per lease ``None`` when renewed or undecided, or why it is lost
        (:func:`.renewing.renew`)."""
        return renewing.renew(self, leases)

    def close(self) -> None:
        for node in self.nodes:
            node.close()


#: Seconds between reads of a queued holder not settled yet (:meth:`LockManager.confirm_holder`).
CONFIRM_POLL = 0.05
#: Holders that had not settled and went away (undone) before a duplicate publishes without
#: its queued lock (each try waits at most ``settle_time``, twice that for a holder seen gone).
CONFIRM_TRIES = 3


class PendingAcquire:
    """An acquisition sent by :meth:`LockManager.send_queued`, its reply not read yet."""

    def __init__(
        self,
        manager: LockManager,
        request: _Request,
        keys: tuple[str, str, str],
        head: str,
        started: float,
        deferred: Deferred,
    ) -> None:
        self.key = request.key
        self._manager = manager
        self._request = request
        self._keys = keys
        self._head = head
        self._started = started
        self._deferred = deferred

    @property
    def nonce(self) -> str:
        """The random nonce of the acquisition sent (whether or not it took the key)."""
        return head_nonce(self._head)

    def finish(self) -> Lease:
        """Read the reply: the lease, or :class:`LockContended` / :class:`LockUnavailable`."""
        manager = self._manager
        try:
            reply = self._deferred.result()
        except BaseException:
            manager._void(
                list(manager.nodes), self._keys, self._head, self._started + self._request.ttl
            )
            raise
        outcome = manager._outcome(self._request, self._keys, self._head, self._started, [reply])
        if isinstance(outcome, Lease):
            return announce_won(outcome, self._started, None)
        raise manager._refused(self.key, outcome)


def _hurry(node: Node) -> None:
    """A node's sentinels announced a new master: the new master's copies of the keys expire
    unless renewed there, so every lease of a manager using that node is renewed at once."""
    watchdog.hurry(lambda backend: isinstance(backend, LockManager) and node in backend.nodes)


nodes.switch_hooks.append(_hurry)
