"""The Celery app the worker tests run in real ``celery worker`` processes.

Configured from the environment the test fixtures set (broker, result backend, lock URLs,
journal). Every task writes what it does to a journal (a Redis list, written before and after
the body's work, so it survives the process being killed): event, task id, key, fencing token,
``time.monotonic()`` (CLOCK_MONOTONIC, comparable across processes on one machine), pid.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals
from celery.exceptions import Ignore, MaxRetriesExceededError, Reject, Retry

from celery_dlock import LockLost, SingletonTask, lock_contended, lock_lost
from celery_dlock.compat import QueueOnce, Singleton


class SupportApp(Celery):
    """A Celery app whose tasks keep the names they had when these apps lived in ``tests/``
    (``tests.worker_app.seam``, not ``tests.support.worker_app.seam``): workers of an older
    tree run beside this one's under those names (tests/upgrade/test_rolling_upgrade.py),
    and lock keys derived from them are what the tests read."""

    def gen_task_name(self, name: str, module: str) -> str:
        return super().gen_task_name(name, module.replace("tests.support.", "tests.", 1))


app = SupportApp(
    "worker_app",
    broker=os.environ.get("DLOCK_TEST_BROKER", "redis://127.0.0.1:6379/0"),
    backend=os.environ.get("DLOCK_TEST_BACKEND", "redis://127.0.0.1:6379/1"),
)
app.conf.update(
    # DLOCK_TEST_LOCK_URL: one URL that may hold commas (Sentinel's host list).
    dlock_urls=[os.environ["DLOCK_TEST_LOCK_URL"]]
    if os.environ.get("DLOCK_TEST_LOCK_URL")
    else os.environ.get("DLOCK_TEST_LOCK_URLS", "redis://127.0.0.1:6379/2").split(","),
    dlock_node_timeout=0.5,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    task_acks_late=os.environ.get("DLOCK_TEST_ACKS_LATE") == "1",
    task_reject_on_worker_lost=os.environ.get("DLOCK_TEST_REJECT_ON_LOST") == "1",
    worker_hijack_root_logger=False,
    result_expires=600,
)
if os.environ.get("DLOCK_TEST_VISIBILITY"):
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["DLOCK_TEST_VISIBILITY"])
    }
    if os.environ.get("DLOCK_TEST_RESTORE_EVERY"):
        # Look for unacked messages past their visibility timeout this often (kombu's default
        # is about every 100 s), so a redelivery comes within a test's patience.
        app.conf.broker_transport_options.update(
            unacked_restore_interval=float(os.environ["DLOCK_TEST_RESTORE_EVERY"]),
            unacked_restore_throttle=1,
        )

if os.environ.get("DLOCK_TEST_BEAT"):
    # "name:seconds-the-body-takes[:period]", one entry sent every period (default a second).
    beat_name, beat_secs, *beat_period = os.environ["DLOCK_TEST_BEAT"].split(":")
    app.conf.beat_schedule = {
        "every-second": {
            "task": "tests.worker_app.ticked",
            "schedule": float(beat_period[0]) if beat_period else 1.0,
            "args": (beat_name, float(beat_secs)),
        }
    }
    app.conf.dlock_beat_ttl = float(os.environ.get("DLOCK_TEST_BEAT_TTL", "3"))

_journal: redis.Redis | None = None


def journal() -> redis.Redis:
    global _journal
    if _journal is None or _journal.connection_pool.pid != os.getpid():
        _journal = redis.Redis.from_url(
            os.environ.get("DLOCK_TEST_JOURNAL", "redis://127.0.0.1:6379/3")
        )
    return _journal


def record(event: str, **fields: Any) -> None:
    entry = {"event": event, "t": time.monotonic(), "pid": os.getpid(), **fields}
    journal().rpush("journal", json.dumps(entry, default=str))


@signals.worker_ready.connect
def _ready(sender: Any = None, **_: Any) -> None:
    record("worker_ready", hostname=getattr(sender, "hostname", None))


@lock_lost.connect
def _lost(
    sender: Any = None, key: str = "", reason: str = "", task_id: Any = None, **_: Any
) -> None:
    record("lost", key=key, reason=reason, id=task_id)


@lock_contended.connect
def _contended(
    sender: Any = None, key: str = "", task_id: Any = None, policy: str = "", **kw: Any
) -> None:
    holder = kw.get("holder")
    record(
        "contended",
        key=key,
        id=task_id,
        policy=policy,
        retry_in=kw.get("retry_in"),
        holder=getattr(holder, "holder", None),
    )


# The two writers of a revoked task's state: the worker's parent stores REVOKED, then sends
# task_revoked; the pool process stores the body's error, then sends task_failure. Recorded
# after each store, so a test can wait until both have written (tests/celery/test_exit_paths.py).
@signals.task_revoked.connect
def _revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    record("revoked", id=getattr(request, "id", None))


@signals.task_failure.connect
def _failed(sender: Any = None, task_id: Any = None, exception: Any = None, **_: Any) -> None:
    record("failed", id=task_id, error=type(exception).__name__)


def _body(task: Any, name: str, secs: float, **extra: Any) -> None:
    lease = task.lease
    request = task.request
    base = {
        "id": request.id,
        "key": lease.key if lease else None,
        "token": lease.token if lease else None,
        "retries": request.retries,
        "redelivered": (request.delivery_info or {}).get("redelivered"),
        "name": name,
        **extra,
    }
    record("start", **base)
    end = time.monotonic() + secs
    try:
        while time.monotonic() < end:  # the body's "work", in slices (threads-pool interrupts)
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))
    except LockLost as exc:  # what the body itself sees when its lease is lost
        record(
            "interrupted",
            **base,
            error=str(exc),
            error_key=exc.key,
            error_reason=exc.reason,
            error_token=exc.token,
        )
        raise
    record("end", **base)


@app.task(base=SingletonTask, bind=True, lock_ttl=3)
def drop_task(self: Any, name: str, secs: float = 0.0) -> str:
    _body(self, name, secs)
    return name


@app.task(
    base=SingletonTask,
    bind=True,
    lock_key=["name"],
    lock_ttl=3,
    on_duplicate="requeue",
    lock_requeue_delay=0.2,
    lock_requeue_max_delay=1.0,
    lock_requeue_max=200,
)
def requeue_task(self: Any, name: str, n: int, secs: float = 0.0) -> int:
    _body(self, name, secs, n=n)
    return n


@app.task(base=SingletonTask, bind=True, lock_key=["name"], on_duplicate="raise", lock_ttl=3)
def raise_task(self: Any, name: str, n: int = 0, secs: float = 0.0) -> int:
    _body(self, name, secs, n=n)
    return n


@app.task(
    base=SingletonTask, bind=True, lock_key=["name"], on_duplicate="wait", lock_wait=20, lock_ttl=3
)
def wait_task(self: Any, name: str, n: int = 0, secs: float = 0.0) -> int:
    _body(self, name, secs, n=n)
    return n


@app.task(base=SingletonTask, bind=True, lock_key="meta:{source}:{entity}", lock_ttl=3)
def collect(self: Any, source: str, entity: str, window: Any = None, secs: float = 0.0) -> str:
    _body(self, f"{source}:{entity}", secs)
    return f"{source}:{entity}"


@app.task(base=SingletonTask, bind=True, lock_ttl=1.5)
def lossy(self: Any, name: str, secs: float = 10.0) -> str:
    _body(self, name, secs)
    return name


@app.task(base=SingletonTask, bind=True, lock_ttl=2)
def long_task(self: Any, name: str, secs: float = 30.0) -> str:
    _body(self, name, secs)
    return name


@app.task(base=SingletonTask, bind=True, lock_ttl=3, max_retries=3)
def flaky(self: Any, name: str, countdown: float = 0.2) -> int:
    _body(self, name, 0.1)
    if self.request.retries == 0:
        raise self.retry(countdown=countdown)
    return int(self.request.retries)


@app.task(base=SingletonTask, bind=True, lock_on="enqueue", lock_ttl=3, lock_queued_ttl=60)
def enqueued(self: Any, name: str, secs: float = 0.0) -> str:
    _body(self, name, secs)
    return name


@app.task(base=SingletonTask, bind=True, lock_on="enqueue", lock_ttl=3, lock_queued_ttl=60)
def enqueued_flaky(self: Any, name: str, countdown: float = 2.0) -> int:
    _body(self, name, 0.1)
    if self.request.retries == 0:
        raise self.retry(countdown=countdown)
    return int(self.request.retries)


@app.task(base=SingletonTask, bind=True, lock_ttl=3)
def ticked(self: Any, name: str, secs: float = 0.0) -> str:
    tick = getattr(self.request, "dlock_tick", None)
    sender = getattr(self.request, "dlock_beat", None)
    _body(self, name, secs, tick=tick, beat=sender)
    return name


@app.task(base=SingletonTask, bind=True)
def keyed_by_everything(self: Any, payload: Any) -> str:
    return "ran"


@app.task(base=SingletonTask, bind=True, lock_ttl=3)
def ignoring(self: Any, name: str) -> None:
    _body(self, name, 0.0)
    raise Ignore()


@app.task(base=SingletonTask, bind=True, lock_ttl=3)
def rejecting(self: Any, name: str) -> None:
    _body(self, name, 0.0)
    raise Reject("rejected on purpose", requeue=False)


@app.task(base=SingletonTask, bind=True, lock_ttl=0.6, lock_max_hold=1.0)
def bounded(self: Any, name: str, secs: float = 5.0) -> str:
    _body(self, name, secs)
    return name


@app.task(base=SingletonTask, bind=True, lock_key="failover:{name}", lock_ttl=9)
def failover_task(self: Any, name: str, secs: float = 14.0) -> str:
    """A long body under a lease longer than Sentinel's failover
    (tests/backends/redis/test_sentinel_failover.py)."""
    _body(self, name, secs)
    return name


@app.task(base=SingletonTask, bind=True, lock_ttl=3, on_lock_lost="flag")
def flagged(self: Any, name: str, secs: float = 2.0) -> bool:
    _body(self, name, secs)
    return bool(self.lease.lost)


# -- the seams: every way a body ends (tests/celery/test_task_lifecycle.py,
# tests/celery/test_exit_paths.py) ----------------------------------------------------------------
#
# All of them lock "seam:{name}", so a probe (below) contends with whichever runs. A body
# records "start", works ``secs`` in slices, ends the way ``how`` says, and records "end" with
# how it ended, whatever ended it: only SIGKILL leaves no "end".


def _work(secs: float) -> None:
    end = time.monotonic() + secs
    while time.monotonic() < end:  # in slices: the threads pool's interrupts land between them
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))


def _seam(task: Any, name: str, how: str, secs: float) -> Any:
    request = task.request
    lease = task.lease
    base = {
        "id": request.id,
        "name": name,
        "how": how,
        "retries": request.retries,
        "key": lease.key if lease else None,
        "token": lease.token if lease else None,
        "redelivered": (request.delivery_info or {}).get("redelivered"),
    }
    record("start", **base)
    ended = "returned"
    try:
        return _seam_ending(task, name, how, secs, base)
    except BaseException as exc:
        ended = type(exc).__name__
        raise
    finally:
        record("end", **base, ended=ended)


def _seam_ending(task: Any, name: str, how: str, secs: float, base: dict[str, Any]) -> Any:
    request = task.request
    if how == "exhausted_fallback":
        try:
            raise task.retry(countdown=0.2, max_retries=0)
        except MaxRetriesExceededError:  # Celery's idiom: no retries left, do something else
            lease = task.lease
            record("fallback", **base, lost=lease.lost, released=lease.released)
            _work(secs)
            return "fallback"
    if how == "republish_own":
        # "Run me again" without retry(): the body publishes its own task id, and goes on.
        task.apply_async((name, "return", secs), task_id=request.id)
        record("republished", **base)
    if how == "reschedule":
        # The body schedules its next run (a new task id, the same key) for after it ends.
        again = task.apply_async((name, "return", secs), countdown=secs + 1.0)
        record("rescheduled", **base, new=again.id)
    if how == "replace":
        # Replaced by this same call (the same key, the task id inherited): the body ends here.
        _work(secs)
        return task.replace(task.s(name, "return", secs))
    if how == "retry_caught" and request.retries == 0:
        # The body catches Celery's Retry and goes on: the retry is published all the same.
        try:
            raise task.retry(countdown=0)
        except Retry:
            record("retry_caught", **base)
        _work(secs)
        return name
    if how in ("retry", "retry_nothrow", "retry_caught") and request.retries > 0:
        return name  # the retried run
    if how == "retry_nothrow":
        # Celery's throw=False: the retry is published and this body goes on to its end.
        task.retry(countdown=0, throw=False)
        _work(secs)
        return name
    _work(secs)
    if how == "retry":
        raise task.retry(countdown=0.2)
    if how == "exhausted_raise":
        raise task.retry(countdown=0.2, max_retries=0)
    if how == "raise":
        raise ValueError(f"{name} failed on purpose")
    if how == "ignore":
        raise Ignore()
    if how == "reject_requeue" and not _ran_before(request.id):
        raise Reject("rejected on purpose, requeued", requeue=True)
    if how == "reject":
        raise Reject("rejected on purpose", requeue=False)
    return name


def _ran_before(task_id: str) -> bool:
    starts = [
        e
        for e in (json.loads(raw) for raw in journal().lrange("journal", 0, -1))
        if e["event"] == "start" and e.get("id") == task_id
    ]
    return len(starts) > 1


@app.task(base=SingletonTask, bind=True, lock_key="seam:{name}", lock_ttl=2, max_retries=3)
def seam(self: Any, name: str, how: str = "return", secs: float = 1.0) -> Any:
    return _seam(self, name, how, secs)


@app.task(
    base=SingletonTask, bind=True, lock_key="seam:{name}", lock_ttl=2, max_retries=3, acks_late=True
)
def seam_late(self: Any, name: str, how: str = "return", secs: float = 1.0) -> Any:
    return _seam(self, name, how, secs)


@app.task(base=SingletonTask, bind=True, lock_key="seam:{name}", lock_ttl=2, lock_on="enqueue")
def seam_enqueued(self: Any, name: str, how: str = "return", secs: float = 1.0) -> Any:
    return _seam(self, name, how, secs)


@app.task(base=SingletonTask, bind=True, lock_key="seam:{name}", lock_ttl=2)
def seam_probe(self: Any, name: str) -> str:
    """A second execution of a seam's key: dropped while the key is held, else runs."""
    return str(_seam(self, name, "return", 0.0))


@app.task(base=SingletonTask, bind=True, lock_ttl=2, lock_on="enqueue")
def seam_payload(self: Any, payload: Any, name: str = "payload") -> str:
    """Keyed on every argument in enqueue-time mode: the publisher's key must be the worker's."""
    _seam(self, name, "return", 0.0)
    return name


# -- the publish-shape matrix (tests/celery/test_publish_matrix.py) --------------------------------


@app.task
def gather(values: Any) -> Any:
    """A chord's callback, a chain's tail: hands back what it was given."""
    return values


@app.task
def linked(value: Any, name: str) -> None:
    """A ``link=`` callback: records that it ran, with the value it was given."""
    record("linked", name=name, value=value)


class OptOutSingleton(Singleton):
    """Nautobot's pattern: a call that must not be locked goes to Celery's own publish by
    calling past the drop-in class, ``super(Singleton, self).apply_async(...)``."""

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        if options.pop("unlocked", False):
            return super(Singleton, self).apply_async(args, kwargs, **options)
        return super().apply_async(args, kwargs, **options)


class OptOutQueueOnce(QueueOnce):
    """The same past celery-once's class: ``super(QueueOnce, self).apply_async(...)``."""

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        if options.pop("unlocked", False):
            return super(QueueOnce, self).apply_async(args, kwargs, **options)
        return super().apply_async(args, kwargs, **options)


@app.task(base=OptOutSingleton, bind=True, unique_on=["name"], lock_ttl=2)
def seam_singleton(self: Any, name: str, how: str = "return", secs: float = 1.0) -> Any:
    return _seam(self, name, how, secs)


@app.task(base=OptOutQueueOnce, bind=True, once={"keys": ["name"], "graceful": True}, lock_ttl=2)
def seam_once(self: Any, name: str, how: str = "return", secs: float = 1.0) -> Any:
    return _seam(self, name, how, secs)


@app.task(
    base=SingletonTask,
    bind=True,
    lock_key="seam:{name}",
    lock_ttl=2,
    lock_on="enqueue",
    lock_queued_ttl=1,
)
def seam_enqueued_short(self: Any, name: str, how: str = "return", secs: float = 1.0) -> Any:
    """``seam_enqueued`` whose queued lock lives 1 s plus any countdown or eta."""
    return _seam(self, name, how, secs)
