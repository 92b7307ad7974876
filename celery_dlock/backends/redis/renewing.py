"""Renewing Redis leases: the leases the watchdog found due, in script calls of at most
:data:`BATCH` leases per node (and one hash slot each on Redis Cluster), and what each node's
answer means for each lease.

:class:`~.redlock.LockManager` calls it for :meth:`celery_dlock.core.backend.Backend.renew`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from redis.crc import key_slot

from celery_dlock.backends.redis import decisions
from celery_dlock.backends.redis.decisions import ms
from celery_dlock.backends.redis.diagnose import describe
from celery_dlock.backends.redis.inspection import RedisNodes, revoked_key
from celery_dlock.backends.redis.transport import run_script
from celery_dlock.core.config import drift
from celery_dlock.core.holder import head_nonce
from celery_dlock.core.lease import Lease

log_renew = logging.getLogger("celery_dlock.renew")

#: Most leases one script call renews. A call holds its Redis node for its whole run, in
#: proportion to its leases, so a process holding many leases renews them in calls of this
#: many, one after another, and no call holds the node long (the measured figures:
#: benchmarks/README.md, "Figures behind the code's constants").
BATCH = 200


def renew(m: RedisNodes, leases: Sequence[Lease]) -> list[str | None]:
    """Extend every lease in script calls of at most :data:`BATCH` leases per node (and one
    hash slot each on Redis Cluster), one call after another.

    Returns, per lease, ``None`` when renewed or undecided (nodes did not answer; the
    watchdog retries until the lease's validity runs out), or the reason it is lost.
    """
    if not m.cluster and len(leases) <= BATCH:
        return renew_batch(m, leases)
    # A script may touch one slot only (Cluster): one call per slot and batch, in turn, each
    # bounded by the validity of its own leases.
    groups: dict[int, list[int]] = {}
    for i, lease in enumerate(leases):
        slot = key_slot(m.redis_keys(lease.key)[0].encode()) if m.cluster else 0
        groups.setdefault(slot, []).append(i)
    out: list[str | None] = [None] * len(leases)
    for group in groups.values():
        for start in range(0, len(group), BATCH):
            batch = group[start : start + BATCH]
            outcomes = renew_batch(m, [leases[i] for i in batch])
            for i, outcome in zip(batch, outcomes, strict=True):
                out[i] = outcome
    return out


def renew_batch(m: RedisNodes, leases: Sequence[Lease]) -> list[str | None]:
    """:func:`renew` for leases whose keys one script call may touch together."""
    keys: list[str] = []
    args: list[Any] = ["1" if m.redlock else "0", ms(m.settings.fence_retention)]
    for lease in leases:
        lock_key, fence_key, _ = m.redis_keys(lease.key)
        keys += (lock_key, fence_key, revoked_key(lock_key, head_nonce(lease.head)))
        args += (lease.head, ms(lease.ttl), lease.token)
    started = time.monotonic()
    timeout = max(0.001, min(m.settings.node_timeout, *(x.valid_for for x in leases)))
    replies = run_script(m.nodes, "extend", keys, args, timeout)
    failed = [(n, r) for n, r in zip(m.nodes, replies, strict=True) if isinstance(r, BaseException)]
    silent = decisions.silent(replies) if failed else None
    if silent:  # a late renewal there could re-take a released key: the release voids it
        for lease in leases:
            if isinstance(lease, decisions.RedisLease):
                lease._silent = silent if lease._silent is None else lease._silent | silent
    if failed:
        log_renew.warning(
            "renewal: %d of %d node(s) did not answer: %s: %s",
            len(failed),
            len(m.nodes),
            failed[0][0].shown,
            describe(failed[0][1], failed[0][0]),
        )
    out: list[str | None] = []
    for j, lease in enumerate(leases):
        codes = [None if isinstance(r, BaseException) else int(r[j]) for r in replies]
        verdict = decisions.renewal(codes, m.quorum, m.redlock)
        if verdict.renewed:
            lease.renewed(started, started + lease.ttl - drift(lease.ttl, m.settings.drift_factor))
        # lost None and not renewed: it might still hold; retried before validity runs out
        out.append(verdict.lost)
    return out
