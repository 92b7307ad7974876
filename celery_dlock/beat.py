"""Celery beat: each scheduled tick runs once cluster-wide, and beat itself highly available.

Two independent mechanisms, usable alone or together:

* **Once per tick** (any scheduler class). In a beat process, every send of a scheduled
  :class:`~celery_dlock.SingletonTask` takes a *tick key* naming the schedule entry and its
  slot — the entry's period (or the minute, for crontab and solar schedules) that the send falls
  in — kept until the slot ends. A second send for the same slot, from another beat process or a
  restarted one, is marked as a duplicate and dropped by the worker without running the body,
  however late it arrives. The slot travels in the ``dlock_tick`` message header.
  It hooks the scheduler *instance* when beat starts (``beat_init``), so it works with the stock
  scheduler, django-celery-beat's, RedBeat's, or any other subclass of ``celery.beat.Scheduler``.
  Slots are computed from the wall clock, so beat hosts need NTP-disciplined clocks.

* **A leader-elected scheduler**, ``celery -A proj beat -S celery_dlock.beat:LeaderScheduler``
  (or ``-S dlock``): any number of beat processes run, only the holder of the leader lease
  sends. Followers try to take the lease each time the leader's would expire, so they take over
  within about one ``dlock_beat_ttl`` of the leader dying. The leader checks its lease right
  before every send, and its view of the lease ends before Redis's (seed 000), so a leader that
  lost it stops sending before a follower can start.

Settings: ``dlock_beat_ttl`` (leader lease, seconds, default 10), ``dlock_beat_key`` (leader
lock key, default ``"beat-leader:<app main name>"``).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from typing import Any

from celery.beat import PersistentScheduler, ScheduleEntry
from celery.signals import beat_init

from celery_dlock.errors import LockContended, LockUnavailable
from celery_dlock.lease import Lease
from celery_dlock.registry import manager_for

log = logging.getLogger("celery_dlock.beat")

HEADER_TICK = "dlock_tick"  # "<entry name>:<slot index>" of a beat send
HEADER_BEAT = "dlock_beat"  # "<host>:<pid>" of the beat process that sent it
#: Slot length for schedules without a fixed period (crontab, solar): their finest grain.
MINUTE = 60.0
#: A tick key outlives its slot by this much, so a send just past the boundary from a beat
#: whose clock is a little behind still finds it.
TICK_GRACE = 1.0

_current = threading.local()  # the entry the beat thread is sending right now


def tick_slot(entry: ScheduleEntry, now: float | None = None) -> tuple[int, float]:
    """The slot a send of ``entry`` at ``now`` (wall seconds) belongs to: (index, length)."""
    run_every = getattr(entry.schedule, "run_every", None)
    period = run_every.total_seconds() if run_every is not None else MINUTE
    if period <= 0:
        period = MINUTE
    now = time.time() if now is None else now
    return math.floor(now / period), period


Tick = tuple[Any, ScheduleEntry, int, float]  # app, entry, slot index, slot length


def current_tick() -> Tick | None:
    """The beat send under way in this thread (app, entry, slot), or None outside one."""
    found: Tick | None = getattr(_current, "tick", None)
    return found


def _wrap_apply_async(scheduler: Any) -> None:
    """Make this scheduler instance record which entry it sends (for the publish hook)."""
    if getattr(scheduler, "_dlock_wrapped", False):
        return
    original = scheduler.apply_async

    def apply_async(entry: ScheduleEntry, *args: Any, **kwargs: Any) -> Any:
        slot, period = tick_slot(entry)
        _current.tick = (scheduler.app, entry, slot, period)
        try:
            return original(entry, *args, **kwargs)
        finally:
            _current.tick = None

    scheduler.apply_async = apply_async
    scheduler._dlock_wrapped = True


@beat_init.connect
def _on_beat_init(sender: Any = None, **_: Any) -> None:
    scheduler = getattr(sender, "scheduler", None)
    if scheduler is not None:
        _wrap_apply_async(scheduler)


def tick_key(entry_name: str, slot: int, period: float) -> str:
    """The key one slot of one schedule entry holds: entry name and the slot's start time."""
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(slot * period))
    return f"beat-tick:{entry_name}:{start}"


def claim_tick(tick: Tick, task: Any, task_id: str) -> str | None:
    """Take the tick key of a beat send; the id of the send that already has it, or None.

    Called in the beat process while a scheduled SingletonTask is published. A send that
    cannot reach Redis goes out unmarked (the execution-time lock still keeps its body from
    overlapping another).
    """
    _, entry, slot, period = tick
    key = tick_key(str(entry.name or entry.task), slot, period)
    ttl = (slot + 1) * period - time.time() + TICK_GRACE
    manager = task._dlock().manager
    try:
        claimed = manager.acquire(key, ttl=max(ttl, 0.1), holder=task_id, renew=False)
    except LockContended as exc:
        first = exc.holder.holder if exc.holder else None
        log.info("beat: %s for slot %s was already sent as %s", entry.name, slot, first)
        return first or "?"
    except LockUnavailable as exc:
        log.warning("beat: cannot record the tick of %s: %s", entry.name, exc)
        return None
    manager.forget(claimed)  # kept until the slot ends, never released
    return None


class LeaderScheduler(PersistentScheduler):
    """A beat scheduler that sends only while it holds the cluster's leader lease."""

    #: How often (seconds, at most) a follower looks again when it could not tell when the
    #: leader's lease ends.
    follower_poll = 1.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lease: Lease | None = None
        self._identity = f"beat@{socket.gethostname()}:{os.getpid()}"
        super().__init__(*args, **kwargs)

    def _settings(self) -> tuple[str, float]:
        conf = self.app.conf
        key = conf.get("dlock_beat_key") or f"beat-leader:{self.app.main or 'celery'}"
        ttl = float(conf.get("dlock_beat_ttl", 10.0))
        return key, ttl

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
            return max(0.05, min(wait + 0.01, self._max_interval()))
        except LockUnavailable as exc:
            log.warning("beat: cannot reach Redis for the leader lease: %s", exc)
            return min(self.follower_poll, self._max_interval())
        log.info("beat: %s is the leader (fencing token %s)", self._identity, self._lease.token)
        # Our schedule file may be behind the old leader's: entries due "now" are sent
        # again; the tick keys of SingletonTasks keep those from running twice.
        return None

    def tick(self, *args: Any, **kwargs: Any) -> float:
        wait = self._lead()
        if wait is not None:
            return wait
        interval: float = super().tick(*args, **kwargs)
        return interval

    def apply_async(self, entry: ScheduleEntry, *args: Any, **kwargs: Any) -> Any:
        # Right before the send: a lease that ran out, even unnoticed, means someone else
        # may lead now, so this beat must not send.
        if not self.is_leader:
            log.warning("beat: not sending %s: not the leader any more", entry.name)
            return None
        return super().apply_async(entry, *args, **kwargs)

    def close(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        super().close()
