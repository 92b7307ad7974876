"""The Celery app the fault harness runs in real workers: ``celery -A tests.support.faults.app``.

Configured from the environment the harness sets:

``FAULTS_BROKER``     a Redis nobody injects faults into: broker (db 0), results (db 1), the
                      fenced store (db 2)
``FAULTS_LOCK_URLS``  the lock servers, comma-separated (one, or five for Redlock)
``FAULTS_DIR``        where every process writes its history
``FAULTS_TTL``        the lease ttl, seconds
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import before_task_publish, task_prerun

from celery_dlock import LockLost, SingletonTask, lock_lost
from tests.support.faults import history

BROKER = os.environ.get("FAULTS_BROKER", "redis://127.0.0.1:6379")
TTL = float(os.environ.get("FAULTS_TTL", "2"))
DIR = os.environ.get("FAULTS_DIR", "/tmp")

app = Celery("faults", broker=f"{BROKER}/0", backend=f"{BROKER}/1")
app.conf.update(
    dlock_urls=os.environ.get("FAULTS_LOCK_URLS", f"{BROKER}/3").split(","),
    dlock_node_timeout=0.2,
    task_acks_late=True,  # a killed worker's message is delivered again
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_transport_options={
        "visibility_timeout": 6.0,  # longer than any job's run, shorter than the test
        "unacked_restore_interval": 1,  # kombu >= 5.7: look for orphaned messages often
        "unacked_restore_throttle": 1,
        # A worker killed while it held the restore mutex must not stop restores for the
        # default 5 minutes.
        "unacked_mutex_expire": 3,
    },
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=3600,
)

# The fenced store (fencing tokens) plus a per-job idempotency check, in one script:
# a write carrying a token older than the key's latest is refused; a job applied before is
# not applied again. Every attempt is logged with the writer's clock.
WRITE = """
local latest = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local token = tonumber(ARGV[2])
local outcome
if token < latest then
  outcome = 'stale'
elseif redis.call('SISMEMBER', KEYS[2], ARGV[3]) == 1 then
  outcome = 'again'
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('SADD', KEYS[2], ARGV[3])
  outcome = 'applied'
end
redis.call('RPUSH', KEYS[3], cjson.encode({key=ARGV[1], token=ARGV[2], job=ARGV[3],
  t=tonumber(ARGV[4]), pid=tonumber(ARGV[5]), outcome=outcome}))
return outcome
"""

_store: Any = None


def store_write(key: str, token: int, job: str) -> str:
    global _store
    if _store is None or _store[0] != os.getpid():
        client = redis.Redis.from_url(f"{BROKER}/2")
        _store = (os.getpid(), client.register_script(WRITE))
    script = _store[1]
    args = [key, str(token), job, repr(time.monotonic()), str(os.getpid())]
    outcome = script(keys=["latest", "applied", "writes"], args=args)
    return outcome.decode() if isinstance(outcome, bytes) else str(outcome)


@task_prerun.connect
def _prerun(task_id: str | None = None, **_: Any) -> None:
    # The worker is about to run (or drop, or requeue) this message: it was delivered.
    history.record(DIR, "prerun", job=task_id)


@before_task_publish.connect
def _published(headers: Any = None, **_: Any) -> None:
    # A requeue or retry republishes the job under its own id.
    history.record(DIR, "published", job=(headers or {}).get("id"))


@lock_lost.connect
def _lost(sender: Any = None, key: str = "", token: Any = None, reason: str = "", **_: Any) -> None:
    history.record(DIR, "lost", key=key, token=token, reason=reason)


def _body(task: Any, job: str, key: str, secs: float, pause: bool) -> str:
    lease = task.lease
    base = {"job": job, "key": key, "token": lease.token, "task_id": task.request.id}
    history.record(DIR, "start", valid_until=time.monotonic() + lease.valid_for, **base)
    try:
        end = time.monotonic() + secs
        while time.monotonic() < end:
            time.sleep(0.05)
            lease.ensure()
            # Evidence of validity for the checker: the lease is ours until at least then.
            history.record(DIR, "alive", valid_until=time.monotonic() + lease.valid_for, **base)
        lease.ensure()  # right before the write
        checked = time.monotonic()
        valid_until = checked + lease.valid_for
        if pause:
            # A stand-in for a long GC pause between the check and the write: the harness
            # resumes this process after its lease has expired and another took the key.
            history.record(DIR, "pausing", **base)
            os.kill(os.getpid(), signal.SIGSTOP)
        outcome = store_write(key, lease.token, job)
        history.record(DIR, "wrote", outcome=outcome, checked=checked, valid_until=valid_until,
                       **base)  # fmt: skip
        if outcome == "stale":
            raise LockLost("the store refused our token", key=key, reason="stale write")
    except LockLost as exc:
        history.record(DIR, "end", outcome="lost", **base)
        raise task.retry(exc=exc, countdown=0.2, max_retries=None) from None
    history.record(DIR, "end", outcome="ok", **base)
    return job


#: Both tasks lock the same keys: a hot key, requeue on contention, quick retries.
OPTIONS: dict[str, Any] = {
    "base": SingletonTask,
    "bind": True,
    "lock_key": "{key}",
    "lock_ttl": TTL,
    "on_duplicate": "requeue",
    "lock_requeue_delay": 0.05,
    "lock_requeue_max_delay": 0.5,
    "lock_requeue_max": 100000,
}


@app.task(**OPTIONS)
def job(self: Any, job: str, key: str, secs: float) -> str:
    """A unit of work on one hot key; a lost lease stops it (LockLost) and it is retried."""
    return _body(self, job, key, secs, pause=False)


# on_lock_lost="flag": the paused write is attempted, so the fence must refuse it.
@app.task(**OPTIONS, on_lock_lost="flag")
def paused_job(self: Any, job: str, key: str, secs: float) -> str:
    """The same work, freezing itself between its last lease check and its write."""
    return _body(self, job, key, secs, pause=self.request.retries == 0)
