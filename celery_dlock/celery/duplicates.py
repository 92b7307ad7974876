"""What an execution does when it cannot take its key: the duplicate policies
(``on_duplicate``: drop, requeue, raise, wait), ``on_lock_unavailable``, and the requeue with
jittered backoff they share; a redelivered copy whose first execution finished is skipped.

Each is called by ``SingletonTask.__call__`` (:mod:`celery_dlock.celery.task`) with the task,
and ends the execution: a drop result, ``Ignore`` after a requeue, or the error raised.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

from celery import Task
from celery.exceptions import Ignore
from celery.utils.time import get_exponential_backoff_interval

from celery_dlock.celery.headers import (
    HEADER_REDELIVERED,
    HEADER_REQUEUES,
    HEADER_TICK,
    HEADER_UNAVAILABLE,
)
from celery_dlock.core.errors import LockContended, LockUnavailable
from celery_dlock.core.holder import Holder
from celery_dlock.core.lease import Lease
from celery_dlock.core.signals import lock_contended

log = logging.getLogger("celery_dlock.task")


class Duplicated(Protocol):
    """What this module needs of a ``SingletonTask`` (which imports this module)."""

    @property
    def name(self) -> Any: ...
    @property
    def request(self) -> Any: ...
    @property
    def on_duplicate(self) -> str: ...
    @property
    def on_lock_unavailable(self) -> str: ...
    @property
    def lock_requeue_max(self) -> int: ...
    @property
    def lock_requeue_delay(self) -> float: ...
    @property
    def lock_requeue_max_delay(self) -> float: ...
    def signature_from_request(self, *args: Any, **kwargs: Any) -> Any: ...


def skip_finished(task: Duplicated, key: str, lease: Lease, task_id: str | None) -> None:
    """A redelivered copy that waited for the first execution, which has finished: end
    without running the body (raises ``Ignore``)."""
    lease.release(wait=False)
    log.info("task %s[%s]: finished already; copy skipped", task.name, task_id)
    signal(task, key, None, "drop")
    raise explained_ignore(task_id)


def contended(
    task: Duplicated, key: str, exc: LockContended, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """The key is held: the task's ``on_duplicate`` policy, or a requeue when another
    execution of this very task id holds it (a retry, a redelivered copy)."""
    request = task.request
    holder = exc.holder
    if holder is not None and holder.task_id == request.id and not holder.queued:
        # Held by another execution of this very task id.
        delivery = request.delivery_info or {}
        if delivery.get("redelivered") or getattr(request, HEADER_REDELIVERED, None):
            # Another delivery of a task whose execution holds the key: still running (a
            # visibility timeout passed with late acks), or dead with its lease not yet
            # expired (a worker lost with reject_on_worker_lost). Come back when that lease
            # could have run out; then run, unless the result says the first finished.
            wait = exc.retry_after if exc.retry_after is not None else task.lock_requeue_delay
            return requeue(task, HEADER_REDELIVERED, exc, args, kwargs, key=key, delay=wait)
        # A retry that found its predecessor's key not yet released: come back soon.
        return requeue(task, HEADER_REQUEUES, exc, args, kwargs, key=key)
    policy = task.on_duplicate
    if policy == "requeue":
        return requeue(task, HEADER_REQUEUES, exc, args, kwargs, key=key)
    signal(task, key, holder, policy)
    if policy == "drop":
        who = holder.describe() if holder else "another holder"
        return drop(
            task, key, holder, holder.task_id if holder else None, f"{key!r} is held by {who}"
        )
    raise exc  # "raise", or "wait" that ran out


def signal(
    task: Duplicated, key: str, holder: Holder | None, policy: str, retry_in: float | None = None
) -> None:
    """Send ``lock_contended`` for this execution: what it does about ``holder`` (``policy``)."""
    lock_contended.send(
        sender=task,
        key=key,
        token=None,
        task_id=task.request.id,
        holder=holder,
        policy=policy,
        retry_in=retry_in,
    )


def drop_marked(task: Duplicated, key: str, duplicate_of: str) -> dict[str, Any]:
    """Drop a message marked a duplicate when it was published (the key was not read)."""
    signal(task, key, None, "drop")
    task_id = task.request.id
    if duplicate_of == task_id:
        # Sent again under the id of the task it duplicates (send_task with a fixed id):
        # store nothing, or this drop's result would stand for that task's own.
        log.info(
            "task %s[%s] dropped: a message of this same task id holds %r and runs instead",
            task.name,
            task_id,
            key,
        )
        raise explained_ignore(task_id)
    tick = getattr(task.request, HEADER_TICK, None)
    if tick:
        entry = str(tick).rsplit(":", 1)[0]
        why = (
            f"beat already sent this run of {entry!r} as task {duplicate_of} (another send "
            "of the entry holds its tick key, which lasts until the entry's next run)"
        )
    else:
        why = f"published while task {duplicate_of} held {key!r}; that task runs instead"
    return drop(task, key, None, duplicate_of, why)


def drop(
    task: Duplicated, key: str, holder: Holder | None, holder_id: str | None, why: str
) -> dict[str, Any]:
    """End the execution without running the body: the drop result, naming the holder."""
    log.info("task %s[%s] dropped: %s", task.name, task.request.id, why)
    return {
        "dlock_dropped": True,
        "key": key,
        "holder": holder_id,
        "holder_host": holder.host if holder else None,
        "holder_pid": holder.pid if holder else None,
        "reason": why,
    }


def unavailable(
    task: Duplicated, key: str, exc: LockUnavailable, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """The lock store cannot be reached: ``on_lock_unavailable`` (requeue, or raise)."""
    if task.on_lock_unavailable == "raise":
        raise exc  # Celery logs the failure, with this message
    return requeue(task, HEADER_UNAVAILABLE, exc, args, kwargs)


def requeue(
    task: Duplicated,
    header: str,
    exc: LockContended | LockUnavailable,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    key: str | None = None,
    delay: float | None = None,
) -> Any:
    """Publish this same task (same id, same options) again after a jittered backoff (or
    ``delay``), and end this execution without a result; after ``lock_requeue_max``
    requeues, fail (a redelivered copy ends quietly instead: the first may still run)."""
    request = task.request
    headers = dict(request.headers or {})
    done = int(headers.get(header, 0))
    if done >= task.lock_requeue_max or request.is_eager:
        if header == HEADER_REDELIVERED:
            log.warning(
                "task %s[%s]: redelivered copy given up after %d requeues: %s",
                *(task.name, request.id, done, exc),
            )
            raise Ignore()
        raise exc
    if delay is None:
        delay = requeue_delay(done, task.lock_requeue_delay, task.lock_requeue_max_delay)
    else:
        delay = min(delay + 0.05, task.lock_requeue_max_delay)
    if key is not None and isinstance(exc, LockContended):
        signal(task, key, exc.holder, "requeue", retry_in=delay)
    headers[header] = done + 1
    signature = task.signature_from_request(
        request, tuple(args), dict(kwargs), countdown=delay, headers=headers
    )
    Task.apply_async(
        cast("Task[Any, Any]", task), signature.args, signature.kwargs, **signature.options
    )
    level = logging.WARNING if isinstance(exc, LockUnavailable) else logging.INFO
    log.log(
        level,
        "task %s[%s] requeued in %.2f s (%d of %d): %s",
        task.name,
        request.id,
        delay,
        done + 1,
        task.lock_requeue_max,
        exc,
    )
    raise explained_ignore(request.id)


def requeue_delay(done: int, first: float, cap: float) -> float:
    """Exponential backoff with full jitter, from Celery's own helper, in milliseconds so the
    jitter is not limited to whole seconds; never below a tenth of the first delay."""
    ms = get_exponential_backoff_interval(
        factor=max(1, round(first * 1000)),
        retries=done,
        maximum=max(1, round(cap * 1000)),
        full_jitter=True,
    )
    return max(ms / 1000.0, first / 10.0)


#: Task ids whose execution this process ended with ``Ignore`` after logging why itself.
_explained: set[str] = set()


def explained_ignore(task_id: str | None) -> Ignore:
    """``Ignore`` for an execution whose end our own log line already explained (a requeue):
    Celery's "Task ... ignored" line for it is dropped, one line per requeue is enough."""
    if task_id:
        if len(_explained) > 1000:  # ids whose Celery line never came (eager runs)
            _explained.clear()
        _explained.add(task_id)
    return Ignore()


class _QuietExplainedIgnores(logging.Filter):
    """On Celery's tracer logger: drops its "ignored" line for the executions above."""

    def filter(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)
        if isinstance(data, dict) and data.get("description") == "ignored":
            task_id = data.get("id")
            if task_id in _explained:
                _explained.discard(task_id)
                return False
        return True


logging.getLogger("celery.app.trace").addFilter(_QuietExplainedIgnores())
