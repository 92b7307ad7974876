"""Celery beat: each scheduled run happens once cluster-wide, and beat itself highly available.

Two independent mechanisms, usable alone or together:

* **Once per run** (any scheduler class). In a beat process, every send of a scheduled
  :class:`~celery_dlock.SingletonTask` takes a *tick key* naming the app and the schedule
  entry, kept until the entry's next run less a small margin. Another send of the entry while
  it exists — from another beat process, a restarted one, or a new leader working from an old
  schedule file — is marked as a duplicate and dropped by the worker without running the body,
  however late it arrives. The key's lifetime is a *duration* the sender computes from the
  schedule (its period; for a crontab, the time to its next fire time), counted by the lock
  Redis's clock from the moment it is set, so the beats' wall clocks need not agree: sends of
  one run from beats whose clocks differ by up to that duration are one run (see
  ``docs/beat.md``). The ``dlock_tick`` header names the entry and the slot the sender's clock
  puts the send in, for logs and idempotency keys.
  It hooks the scheduler *instance* when beat starts (``beat_init``), so it works with the stock
  scheduler, django-celery-beat's, RedBeat's, or any other subclass of ``celery.beat.Scheduler``.

* **A leader-elected scheduler**, ``celery -A proj beat -S
celery_dlock.celery.beat:LeaderScheduler``
  (or ``-S dlock``): any number of beat processes run, only the holder of the leader lease
  sends. Followers try to take the lease each time the leader's would expire, so they take over
  within about one ``dlock_beat_ttl`` of the leader dying. The leader sends only while at least
  a third of its lease is left, and its view of the lease ends before Redis's (the drift
  allowance), so a leader that lost it stops sending before a follower can start.

Settings: ``dlock_beat_ttl`` (leader lease, seconds, default 10), ``dlock_beat_key`` (leader
lock key, default ``"beat-leader:<app main name>"``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery import __version__ as _celery_version
from celery.beat import PersistentScheduler, ScheduleEntry
from celery.signals import beat_init

from celery_dlock.celery.headers import HEADER_BEAT, HEADER_DUPLICATE_OF, HEADER_TICK
from celery_dlock.core.config import beat_settings
from celery_dlock.core.errors import LockContended, LockUnavailable
from celery_dlock.core.lease import Lease
from celery_dlock.core.registry import manager_for

log = logging.getLogger("celery_dlock.beat")

#: Slot length for schedules that are neither intervals nor crontabs (solar): a minute.
MINUTE = 60.0
#: A tick key ends this long before the entry's next run (at most; a quarter of the gap for
#: shorter gaps), so the sending beat's own next send, which can reach Redis a little sooner
#: after this one than the schedule says (a slow publish now, a fast one then), never finds it.
TICK_MARGIN = 1.0
#: How far back to look for a crontab's latest fire time, widening until one is found.
_LOOKBACK = (60.0, 3600.0, 86400.0, 32 * 86400.0, 367 * 86400.0)
_MAX_STEPS = 2000
#: Celery before 5.7 sends a crontab run whose wall-clock time a spring-forward change skipped
#: early, by the shift (Europe/Berlin's daily 02:30 on the change day at 03:00 CEST, not 03:30).
_EARLY_AFTER_SPRING_FORWARD = tuple(int(p) for p in _celery_version.split(".")[:2]) < (5, 7)

_current = threading.local()  # the send under way in the beat thread


@dataclass(frozen=True)
class Tick:
    """One send of one schedule entry: the slot it belongs to."""

    app: Any
    entry: ScheduleEntry
    index: int  # slot number by the sender's clock, for the message header
    start: float  # wall-clock seconds: the scheduled time this send is for
    end: float  # when the next one is due
    gap: float  # seconds from this send to the entry's next run, as this beat schedules it


def tick_slot(entry: ScheduleEntry, now: float | None = None) -> tuple[int, float, float]:
    """The slot a send of ``entry`` at ``now`` (wall seconds) belongs to: (index, start, end).

    Interval schedules: the period that ``now`` falls in, on a grid shared by every beat
    (``floor(now / period)``). Crontabs: the latest fire time not after ``now`` up to the next
    one, so a catch-up send of a missed run (a restarted beat, a new leader working from an
    old schedule file) maps to the run it makes up for. Anything else: the minute.
    """
    now = time.time() if now is None else now
    schedule = entry.schedule
    run_every = getattr(schedule, "run_every", None)
    period = run_every.total_seconds() if run_every is not None else 0.0
    if period > 0:
        index = math.floor(now / period)
        return index, index * period, (index + 1) * period
    window = _crontab_window(schedule, now)
    if window is not None:
        start, end = window
        return math.floor(start / MINUTE), start, end
    index = math.floor(now / MINUTE)
    return index, index * MINUTE, (index + 1) * MINUTE


def tick_gap(entry: ScheduleEntry, now: float | None = None) -> float:
    """Seconds from a send of ``entry`` at ``now`` to its next run, as a beat schedules it.

    Interval schedules: the period (a beat's next send comes a period after this one).
    Crontabs: the time to the next fire time. Anything else: the schedule's own estimate.
    """
    now = time.time() if now is None else now
    schedule: Any = entry.schedule
    run_every = getattr(schedule, "run_every", None)
    period = run_every.total_seconds() if run_every is not None else 0.0
    if period > 0:
        return period
    window = _crontab_window(schedule, now)
    if window is not None:
        return window[1] - now
    try:
        estimate = schedule.remaining_estimate(datetime.fromtimestamp(now, tz=_zone(schedule)))
        return max(float(estimate.total_seconds()), MINUTE)
    except Exception:  # a schedule class that cannot tell: a minute, as its slots are
        return MINUTE


def tick_margin(gap: float) -> float:
    """How long before the next run a tick key ends (see :data:`TICK_MARGIN`)."""
    return min(TICK_MARGIN, gap / 4)


def _zone(schedule: Any) -> Any:
    """The timezone a schedule reads its fields in (the app's ``timezone``), else UTC."""
    try:
        return schedule.tz or timezone.utc
    except Exception:  # no app to ask
        return timezone.utc


def _crontab_window(schedule: Any, now: float) -> tuple[float, float] | None:
    """(latest fire time <= now, the fire time after it) of a crontab-like schedule."""
    if getattr(schedule, "remaining_delta", None) is None:
        return None
    # Asked in the schedule's own timezone, of a copy whose "now" is the moment asked about.
    # Before Celery 5.7, remaining_delta matched the crontab's fields in whatever timezone it
    # was given (a UTC time put "hour=5" at 05:00 UTC), and took the next minute only when
    # the time asked about fell on the real clock's current day.
    zone = _zone(schedule)
    try:
        probe = copy.copy(schedule)
    except Exception:  # a crontab-like class that cannot be copied: ask it as it is
        probe = schedule

    def next_after(t: float) -> float:
        moment = datetime.fromtimestamp(t, tz=zone)
        if probe is not schedule:
            probe.nowfun = lambda: moment
        last, delta, _ = probe.remaining_delta(moment)
        fire: datetime = last + delta
        return fire.timestamp()

    for lookback in _LOOKBACK:
        fire = next_after(now - lookback)
        if fire > now:
            continue
        for _ in range(_MAX_STEPS):
            following = next_after(fire)
            if following > now:
                early = following - now
                if (
                    _EARLY_AFTER_SPRING_FORWARD
                    and early < now - fire
                    and early <= _spring(zone, fire, following)
                ):
                    # Closer to the next run than to the one before, by no more than the
                    # clocks went forward: that early send is the next run's, not a late one
                    # of the run before (whose tick key lives until the next run).
                    return following, next_after(following)
                return fire, following
            fire = following
        return None
    return None


def _spring(zone: Any, before: float, after: float) -> float:
    """Seconds the clocks of ``zone`` went forward between two moments (0 if they did not)."""
    try:
        first = datetime.fromtimestamp(before, tz=zone).utcoffset()
        second = datetime.fromtimestamp(after, tz=zone).utcoffset()
    except Exception:
        return 0.0
    if first is None or second is None:
        return 0.0
    return max((second - first).total_seconds(), 0.0)


def current_tick() -> Tick | None:
    """The beat send under way in this thread, or None outside one."""
    found: Tick | None = getattr(_current, "tick", None)
    return found


def _wrap_apply_async(scheduler: Any) -> None:
    """Make this scheduler instance record which entry it sends (for the publish hook)."""
    if getattr(scheduler, "_dlock_wrapped", False):
        return
    original = scheduler.apply_async

    def apply_async(entry: ScheduleEntry, *args: Any, **kwargs: Any) -> Any:
        now = time.time()
        index, start, end = tick_slot(entry, now)
        _current.tick = Tick(scheduler.app, entry, index, start, end, tick_gap(entry, now))
        _current.claims = []
        try:
            return original(entry, *args, **kwargs)
        except BaseException:
            # Not sent (the broker is down, say): give the slot back, or the other beats'
            # sends of it would be dropped as duplicates of a message that never went out.
            for manager, key, holder in _current.claims:
                with contextlib.suppress(Exception):
                    manager.release_by_task(key, holder)
            raise
        finally:
            _current.tick = None
            _current.claims = []

    scheduler.apply_async = apply_async
    scheduler._dlock_wrapped = True


@beat_init.connect
def _on_beat_init(sender: Any = None, **_: Any) -> None:
    scheduler = getattr(sender, "scheduler", None)
    if scheduler is not None:
        _wrap_apply_async(scheduler)


def tick_key(app_name: str, entry_name: str) -> str:
    """The key a run of one schedule entry holds until the entry's next run."""
    return f"beat-tick:{app_name}:{entry_name}"


def mark_send(task: Any, task_id: str, headers: dict[str, Any]) -> bool:
    """In a beat send of a SingletonTask, claim its slot once and label the message.

    Sets the ``dlock_tick`` and ``dlock_beat`` headers, and ``dlock_duplicate_of`` when another
    send already has this slot; returns whether it is such a duplicate. Outside a beat send,
    or when this message was already labelled, changes nothing.
    """
    tick = current_tick()
    if tick is None or HEADER_TICK in headers:
        return bool(headers.get(HEADER_DUPLICATE_OF))
    headers[HEADER_TICK] = f"{tick.entry.name}:{tick.index}"
    headers[HEADER_BEAT] = f"{socket.gethostname()}:{os.getpid()}"
    first = claim_tick(tick, task, task_id)
    if first is None:
        return False
    headers[HEADER_DUPLICATE_OF] = first
    return True


def claim_tick(tick: Tick, task: Any, task_id: str) -> str | None:
    """Take the tick key of a beat send; the id of the send that already has it, or None.

    A send that cannot reach Redis, or that meets contenders none of which got a majority
    (Redlock), goes out unmarked: the execution-time lock still keeps its body from
    overlapping another.
    """
    entry = tick.entry
    key = tick_key(str(tick.app.main or "celery"), str(entry.name or entry.task))
    # A duration, counted by Redis from now: no beat's wall clock decides when it ends.
    ttl = max(tick.gap - tick_margin(tick.gap), 0.05)
    manager = task._dlock().manager
    try:
        # Never renewed nor released, only replaced once expired: its fence counter has no
        # use beyond the key's own life.
        claimed = manager.acquire(key, ttl=ttl, holder=task_id, renew=False, fence_retention=ttl)
    except LockContended as exc:
        first = exc.holder.task_id if exc.holder else None
        if first is None:
            log.warning("beat: no majority for the tick of %s; sending it unmarked", entry.name)
            return None
        log.info("beat: %s for %s was already sent as %s", entry.name, key, first)
        return first
    except LockUnavailable as exc:
        log.warning("beat: cannot record the tick of %s: %s", entry.name, exc)
        return None
    manager.forget(claimed)  # kept until the slot ends, never released
    claims = getattr(_current, "claims", None)
    if claims is not None:
        claims.append((manager, key, task_id))
    return None


class LeaderScheduler(PersistentScheduler):
    """A beat scheduler that sends only while it holds the cluster's leader lease."""

    #: How often (seconds, at most) a follower looks again when it could not tell when the
    #: leader's lease ends.
    follower_poll = 1.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lease: Lease | None = None
        self._identity = f"beat@{socket.gethostname()}:{os.getpid()}"
        self._following: str | None = None  # the leader this beat last said it follows
        super().__init__(*args, **kwargs)

    def _settings(self) -> tuple[str, float]:
        return beat_settings(self.app)

    def _max_interval(self) -> float:
        return float(self.max_interval or 300)

    @property
    def is_leader(self) -> bool:
        return self._lease is not None and not self._lease.lost

    def _lead(self) -> float | None:
        """Hold or take the leader lease; None when leading, else seconds to wait."""
        if self.is_leader:
            return None
        if self._lease is not None:  # lost: say so once, then try to take it back
            log.warning(
                "beat: %s lost the leader lease: %s", self._identity, self._lease.lost_reason
            )
            self._lease.release()
            self._lease = None
        key, ttl = self._settings()
        try:
            self._lease = manager_for(self.app).acquire(key, ttl=ttl, holder=self._identity)
        except LockContended as exc:
            wait = exc.retry_after if exc.retry_after is not None else self.follower_poll
            self._follow(exc, key)
            return max(0.05, min(wait + 0.01, self._max_interval()))
        except LockUnavailable as exc:
            log.warning("beat: cannot reach the lock store for the leader lease: %s", exc)
            return min(self.follower_poll, self._max_interval())
        log.info("beat: %s is the leader (fencing token %s)", self._identity, self._lease.token)
        self._following = None
        # Our schedule file may be behind the old leader's: entries due "now" are sent
        # again; the tick keys of SingletonTasks keep those from running twice.
        return None

    def _follow(self, refused: LockContended, key: str) -> None:
        """Say once per leader that this beat follows, and whom: until it leads it sends
        nothing, which would otherwise look like a beat that does not work."""
        holder = refused.holder
        leader = (holder.task_id or f"pid {holder.pid} on {holder.host}") if holder else None
        if leader is None or leader == self._following:
            return
        self._following = leader
        # A store with no ttl (ZooKeeper: the lease lasts with the leader's session) names no
        # end; this beat then asks again every follower_poll seconds.
        ends = (
            f"the lease ends within {refused.retry_after:.1f} s unless renewed"
            if refused.retry_after is not None
            else "the lease lasts while the leader's session does"
        )
        log.info(
            "beat: %s follows; %s holds %r (%s); it sends nothing until it leads",
            self._identity,
            leader,
            key,
            ends,
        )

    def tick(self, *args: Any, **kwargs: Any) -> float:
        wait = self._lead()
        if wait is not None:
            return wait
        interval: float = super().tick(*args, **kwargs)
        return interval

    def apply_async(self, entry: ScheduleEntry, *args: Any, **kwargs: Any) -> Any:
        # Right before the send: the lease must outlast the send itself (tick claim, queued
        # lock, the broker's publish and its retries), or a follower could already lead when
        # the message goes out. Renewals keep it above two thirds of the ttl; a third means
        # they have been failing.
        lease = self._lease
        _, ttl = self._settings()
        if lease is None or lease.lost or lease.valid_for < ttl / 3:
            log.warning("beat: not sending %s: the leader lease is lost or running out", entry.name)
            return None
        return super().apply_async(entry, *args, **kwargs)

    def close(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        super().close()
