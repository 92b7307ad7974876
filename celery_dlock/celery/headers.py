"""The message headers celery_dlock adds to the tasks it publishes or marks, and those of
Celery's it reads: a message's times (countdown, eta, expires) as the worker reads them, in
seconds from now, and from them how long the queued lock of a message lives.

Celery keeps custom headers on a retry's message, so the counts below survive retries. Kept
apart so that the publish path, the task and the beat hook can all name them without
importing one another.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from celery.utils.time import maybe_iso8601

HEADER_REQUEUES = "dlock_requeues"  # requeues of a duplicate so far
HEADER_UNAVAILABLE = "dlock_unavailable"  # requeues because Redis was unreachable so far
HEADER_QUEUED = "dlock_queued"  # the message holds a queued lock (enqueue-time mode)
HEADER_DUPLICATE_OF = "dlock_duplicate_of"  # published while this task id held the key
HEADER_REDELIVERED = "dlock_redelivered"  # requeues of a redelivered copy of a running task
HEADER_TICK = "dlock_tick"  # "<entry name>:<slot index>" of a beat send
HEADER_BEAT = "dlock_beat"  # "<host>:<pid>" of the beat process that sent it

#: The headers a worker's requeue of a message adds (duplicates.requeue): a message carrying
#: one was judged by the worker already, and is never taken for a new call at publish.
REQUEUE_HEADERS = (HEADER_REQUEUES, HEADER_UNAVAILABLE, HEADER_REDELIVERED)


def parse_time(eta: Any) -> Any:
    """An eta or expires as the worker reads it: a string with Celery's own ISO 8601 parser
    (dateutil's on Celery 5.7, which takes spellings ``datetime.fromisoformat`` refuses,
    such as a lowercase ``z``, or on Python 3.10 ``Z`` and ``+0900``); None if unreadable."""
    if not isinstance(eta, str):
        return eta
    try:
        return maybe_iso8601(eta)
    except (AttributeError, ValueError, TypeError, OverflowError):
        return None


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


#: The shortest life of a queued lock: that of a message already expired when published.
SHORTEST_QUEUED_TTL = 0.01


def queued_ttl(lifetime: float, options: Mapping[str, Any]) -> float:
    """Seconds the queued lock of a message published with ``options`` lives.

    The task's queued ``lifetime`` plus any countdown or eta (a datetime or, as Celery also
    takes it, an ISO 8601 string); but never past the message's ``expires``: a worker
    discards the message then, and calls published later must not merge into it.
    """
    ttl = lifetime + _delay_of(options)
    left = _seconds_until(options.get("expires"), relative=True)
    if left is not None:
        ttl = min(ttl, left)
    return max(ttl, SHORTEST_QUEUED_TTL)


def _delay_of(options: Mapping[str, Any]) -> float:
    """Seconds until a message with these options may run (countdown or eta)."""
    countdown = options.get("countdown")
    if countdown:
        return max(0.0, float(countdown))
    return max(0.0, _seconds_until(options.get("eta"), relative=False) or 0.0)


def _seconds_until(when: Any, *, relative: bool) -> float | None:
    """Seconds from now until ``when``: a datetime (naive is UTC, as Celery takes it), an ISO
    8601 string, or with ``relative`` a number of seconds; None when there is none (or it
    cannot be read: Celery itself refuses such a value when it builds the message)."""
    if relative and isinstance(when, int | float) and not isinstance(when, bool):
        return float(when)
    moment: Any = parse_time(when) if isinstance(when, str) else when
    if not isinstance(moment, datetime):
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return float((moment - _utcnow()).total_seconds())
