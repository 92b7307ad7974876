"""``SingletonTask``: a Celery task that runs one at a time per lock key, cluster-wide.

::

    from celery_dlock import SingletonTask

    @app.task(base=SingletonTask)                      # key: task name + all arguments
    def replicate(): ...

    @app.task(base=SingletonTask, bind=True, lock_key="meta:{source}:{entity}",
              on_duplicate="requeue", lock_ttl=30)
    def collect(self, source, entity, window=None):
        self.lease.ensure()                            # right before the protected write
        store(rows, fence=self.lease.token)

The lease is taken in the worker right before the body runs (``lock_on="execute"``, the
default) and released on every way out: return, exception, ``self.retry()`` (as the
body ends, after Celery published the retry; not when retries are exhausted), ``Ignore``
and ``Reject``, warm shutdown, and ``revoke(terminate=True)`` (the body as it exits, or the
parent worker process once the killed pool process is gone; a body the signal did not stop
keeps its key). A worker killed outright leaves a lease that expires after ``lock_ttl``.
While the body runs, the renewal watchdog keeps the lease alive; if it is lost the body is
stopped with :class:`~celery_dlock.LockLost` (see ``on_lock_lost``).

With ``lock_on="enqueue"`` the key is taken when the task is published, as celery-singleton
does: a duplicate ``.delay()`` returns the ``AsyncResult`` of the task already queued or running
for that key, and the queued message's lock passes to its execution without a gap (the publish
side is :mod:`celery_dlock.celery.enqueue`).

Every option can be a keyword of ``@app.task(...)`` or a class attribute; they are checked when
the task class is created.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from celery import Task, states
from celery.exceptions import Ignore
from celery.utils.time import get_exponential_backoff_interval

from celery_dlock.celery import enqueue, interrupt
from celery_dlock.celery.headers import (
    HEADER_DUPLICATE_OF,
    HEADER_QUEUED,
    HEADER_REDELIVERED,
    HEADER_REQUEUES,
    HEADER_TICK,
    HEADER_UNAVAILABLE,
)
from celery_dlock.celery.keys import UNKEYABLE_FIX, KeyBuilder
from celery_dlock.core.backend import Backend
from celery_dlock.core.config import check_renew_interval, check_seconds, check_ttl
from celery_dlock.core.errors import (
    ConfigError,
    LockContended,
    LockLost,
    LockUnavailable,
    after_wait,
)
from celery_dlock.core.holder import Holder
from celery_dlock.core.lease import Lease
from celery_dlock.core.registry import manager_for
from celery_dlock.core.signals import lock_contended

log = logging.getLogger("celery_dlock.task")

#: Every task option of SingletonTask (a name close to one of these is a misspelling).
OPTIONS = (
    "lock_key",
    "lock_ttl",
    "on_duplicate",
    "lock_on",
    "lock_wait",
    "lock_requeue_max",
    "lock_requeue_delay",
    "lock_requeue_max_delay",
    "on_lock_lost",
    "lock_max_hold",
    "lock_queued_ttl",
    "on_lock_unavailable",
)
POLICIES = ("drop", "requeue", "raise", "wait")
LOCK_ON = ("execute", "enqueue")
ON_LOST = ("raise", "flag")
ON_UNAVAILABLE = ("requeue", "raise")

LostHandler = Callable[["SingletonTask", Lease, LockLost], None]


def _unique_on(value: Any) -> str:
    # celery-singleton 0.3.1: a string is one name, an empty list the task name alone.
    if isinstance(value, str):
        names: list[str] | None = [value]
    else:
        names = list(value) if isinstance(value, list | tuple) else None
    fix = "lock_key=None (every argument)" if names is None else f"lock_key={names!r}"
    return (
        f"celery-singleton, which SingletonTask does not read: write {fix} instead, or use "
        "base=celery_dlock.compat.Singleton, which reads it"
    )


def _raise_on_duplicate(value: Any) -> str:
    return (
        "celery-singleton, which SingletonTask does not read: a duplicate .delay() cannot "
        "raise here; with lock_on='enqueue' compare the id you get back (the delay_once "
        "recipe), or use on_duplicate='raise' to fail the duplicate in the worker, or use "
        "base=celery_dlock.compat.Singleton, which reads it"
    )


def _lock_expiry(value: Any) -> str:
    return (
        "celery-singleton, which SingletonTask does not read: write lock_queued_ttl= for the "
        "time a message waits in the queue and lock_ttl= for the lease while it runs (renewed, "
        "so it need not cover the run), or use base=celery_dlock.compat.Singleton, which reads it"
    )


def _once(value: Any) -> str:
    parts = ["lock_on='enqueue'"]
    if isinstance(value, Mapping):
        if "keys" in value:
            parts.append(f"lock_key={list(value['keys'])!r}")
        if "timeout" in value:
            parts.append(f"lock_queued_ttl={value['timeout']!r}")
    extra = ""
    if isinstance(value, Mapping) and value.get("unlock_before_run"):
        extra = "; unlock_before_run has no equivalent (on_duplicate='requeue' comes closest)"
    return (
        "celery-once, which SingletonTask does not read: write "
        f"@app.task(base=SingletonTask, {', '.join(parts)}) instead, per task (a duplicate "
        f"gets the queued task's result, as with graceful=True){extra}, or use "
        "base=celery_dlock.compat.QueueOnce, which reads it"
    )


#: celery-singleton's and celery-once's options -> what to write instead (given the value).
PEER_OPTIONS: Mapping[str, Callable[[Any], str]] = {
    "unique_on": _unique_on,
    "raise_on_duplicate": _raise_on_duplicate,
    "lock_expiry": _lock_expiry,
    "once": _once,
}


if TYPE_CHECKING:
    _TaskBase = Task[Any, Any]
else:
    _TaskBase = Task


class SingletonTask(_TaskBase):
    """Task base class: at most one execution per lock key at a time, cluster-wide."""

    #: Marks SingletonTask classes for code that does not import this module (admin.check).
    _dlock_singleton: ClassVar[bool] = True

    #: The lock key: None (task name + every argument), a list of argument names (task name +
    #: those), a template over argument names ("meta:{source}:{entity}", used as written), or
    #: a callable ``(args, kwargs) -> str`` (used as returned).
    lock_key: Any = None
    #: Lease length in seconds, renewed while the body runs; None = the ``dlock_ttl`` setting.
    lock_ttl: float | None = None
    #: What a duplicate does: "drop" (finish at once, result names the holder), "requeue"
    #: (come back later, with backoff), "raise" (fail with LockContended), "wait" (block until
    #: the key frees, up to ``lock_wait``).
    on_duplicate: str = "drop"
    #: When the key is taken: "execute" (in the worker) or "enqueue" (when published).
    lock_on: str = "execute"
    #: Longest wait in seconds for ``on_duplicate="wait"``.
    lock_wait: float = 60.0
    #: Most requeues of one duplicate before it fails with LockContended.
    lock_requeue_max: int = 50
    #: First requeue delay (seconds); later ones double, with full jitter, up to the cap.
    lock_requeue_delay: float = 1.0
    #: Longest requeue delay (seconds). Keep it well under the broker's visibility timeout.
    lock_requeue_max_delay: float = 30.0
    #: What a lost lease does: "raise" (stop the body with LockLost; the task fails), "flag"
    #: (only mark ``self.lease.lost``; the body checks ``self.lease.ensure()``), or a callable
    #: ``(task, lease, error)`` run in the watchdog thread.
    on_lock_lost: Any = "raise"
    #: Longest total time one execution may hold the key, however often it is renewed; None =
    #: the task's hard time limit when one is set (not on the eventlet pool, which enforces
    #: none: a body running past it keeps its key), else no bound.
    lock_max_hold: float | None = None
    #: Enqueue-time mode: how long a queued message's lock lives (seconds, plus any countdown),
    #: so that a lost message cannot block its key for ever.
    lock_queued_ttl: float = 600.0
    #: What a task does when Redis is unreachable as it starts: "requeue" (with backoff, up to
    #: ``lock_requeue_max`` times, then fail with LockUnavailable) or "raise" (fail at once).
    on_lock_unavailable: str = "requeue"

    #: Options of celery-singleton and celery-once that this class does not read, each with
    #: what to write instead. Left in a half-migrated task they would be ignored without a
    #: word, so they are refused, per task and per call (:meth:`_refuse_peer_options`).
    _peer_options: ClassVar[Mapping[str, Callable[[Any], str]]] = PEER_OPTIONS
    #: What the refusal of an argument that cannot be part of a key tells the user to do.
    _unkeyable_fix: ClassVar[str] = UNKEYABLE_FIX

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_options(cls)

    @classmethod
    def _refuse_peer_options(cls, found: Mapping[str, Any], where: str) -> None:
        """Refuse peer options (``found``: name -> value) with a ConfigError naming the
        replacement. The one place they are judged: a class that honours some of them
        overrides this, or narrows ``_peer_options``."""
        if not found:
            return
        name, value = next(iter(found.items()))
        raise ConfigError(
            f"{where}: {name}={value!r} is an option of {cls._peer_options[name](value)} "
            "(see docs/migrating.md)."
        )

    @classmethod
    def bind(cls, app: Any) -> Any:
        bound = super().bind(app)
        if cls.lock_on == "enqueue" and cls.name:
            enqueue.register_enqueue_task(cls.name, app)
        return bound

    # -- the running lease ---------------------------------------------------------------------

    @property
    def lease(self) -> Lease | None:
        """The lease the current execution holds (None outside a running singleton body)."""
        stack = _lease_stack(self)
        return stack[-1] if stack else None

    # -- configuration, resolved on first use --------------------------------------------------

    def _dlock(self) -> _Resolved:
        resolved: _Resolved | None = self.__dict__.get("_dlock_resolved")
        if resolved is None:
            with _resolve_lock:
                resolved = self.__dict__.get("_dlock_resolved")
                if resolved is None:
                    resolved = _Resolved(self)
                    self.__dict__["_dlock_resolved"] = resolved
        return resolved

    def lock_key_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The lock key a call with these arguments takes, once sent with the task's serializer
        (what the worker keys: JSON, say, gives ``{1: 10}`` back as ``{"1": 10}``)."""
        return self._wire_key(args, kwargs, None)

    def _wire_key(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, serializer: Any
    ) -> str:
        """The key of a call about to be published with ``serializer`` (None: the task's)."""
        keys = self._dlock().keys
        return keys(*keys.sent(args or (), kwargs or {}, serializer or self.serializer))

    # -- execution -----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            return super().__call__(*args, **kwargs)  # a plain function call takes no lock
        resolved = self._dlock()
        key = resolved.keys(args, kwargs)
        # Marked at publish as a duplicate: of a queued task (enqueue-time mode, send_task), or
        # of the beat send that already sent this run of its schedule entry.
        duplicate_of = getattr(request, HEADER_DUPLICATE_OF, None)
        if duplicate_of:
            return self._drop_marked(key, duplicate_of)
        key = self._execution_key(key, request)
        # Started before the acquire: the lease's loss handler needs the run to interrupt.
        run = interrupt.start() if self.on_lock_lost == "raise" else None
        lease: Lease | None = None
        try:
            try:
                lease = self._acquire(resolved, key, request, run)
            except LockContended as exc:
                return self._contended(key, exc, args, kwargs)
            except LockUnavailable as exc:
                return self._unavailable(key, exc, args, kwargs)
            if getattr(request, HEADER_REDELIVERED, None) and self._finished(request.id or ""):
                self._skip_finished(key, lease, request.id)
            result = self._run_body(lease, run, args, kwargs)
            if self.on_lock_lost == "raise" and lease.lost:
                # The body finished, but not necessarily alone: do not report success.
                lease.ensure_lost_error()
            return result
        except interrupt.LockLostInterrupt:
            # Raised into the body by the lost-lease interrupt: report the lease's own error.
            if lease is not None:
                lease.ensure_lost_error()
            raise
        finally:
            # Still active: the body never ran, or the interrupt landed in _run_body's stop().
            if run is not None and run.active:
                interrupt.stop(run)

    def _acquire(
        self, resolved: _Resolved, key: str, request: Any, run: interrupt.Run | None
    ) -> Lease:
        """Take the execution's lease (LockContended, LockUnavailable: the caller's policy)."""
        wait = self.lock_wait if self.on_duplicate == "wait" else 0.0
        begun = time.monotonic() if wait else 0.0
        try:
            lease = resolved.manager.acquire_checked(
                key,
                resolved.ttl,
                wait,
                holder=request.id,
                interval=resolved.interval,
                max_hold=resolved.max_hold(request),
                on_lost=self._on_lost_handler(run),
                takeover=request.id if self.lock_on == "enqueue" else None,
                sender=self,
            )
        except LockContended as exc:
            if wait:
                after_wait(exc, time.monotonic() - begun)
            raise
        if run is not None:
            run.lease = lease
        return lease

    def _skip_finished(self, key: str, lease: Lease, task_id: str | None) -> None:
        """A redelivered copy that waited for the first execution, which has finished: end
        without running the body (raises ``Ignore``)."""
        lease.release(wait=False)
        log.info("task %s[%s]: finished already; copy skipped", self.name, task_id)
        self._signal(key, None, "drop")
        raise _explained_ignore(task_id)

    def _run_body(
        self, lease: Lease, run: interrupt.Run | None, args: Any, kwargs: Mapping[str, Any]
    ) -> Any:
        """Run the body under ``lease``; on every way out, stop the interrupt run first (so
        nothing lands once the lease is gone), then let go of the lease."""
        # Kept per thread and task, not on ``self.request``: Celery may push a fresh request
        # context inside ``__call__`` (eager runs on older versions).
        stack = _lease_stack(self)
        stack.append(lease)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            try:
                if run is not None:
                    interrupt.stop(run)
            finally:  # even if the interrupt lands in stop() itself
                stack.pop()
                # Not waiting for the nodes' replies: they decide nothing for this task, and
                # the next task on this process reads them first. A no-op when a retry
                # already released the lease. An enqueue-time retry's (or replacement's)
                # message published by this body gets the key now, as the body has ended.
                if not enqueue.hand_over_at_exit(self, lease):
                    lease.release(wait=False)

    def _execution_key(self, key: str, request: Any) -> str:
        """The key the execution holds while its body runs: the call's own key. A subclass
        may run the body under another key (celery-once's ``unlock_before_run``)."""
        return key

    def _lock_manager(self) -> Backend:
        """The lock manager of this task's nodes: the app's ``dlock_*`` settings. A subclass
        may read its nodes from elsewhere (the compat classes read the peers' settings)."""
        return manager_for(self.app)

    def _queued_ttl(self, options: Mapping[str, Any]) -> float:
        """Seconds a queued message's lock lives (enqueue-time mode), before any countdown;
        ``options`` are the publish's. A subclass may read it per call (celery-once)."""
        return float(self.lock_queued_ttl)

    def _publishes_waited_on_duplicates(self) -> bool:
        """Enqueue-time mode: whether a duplicate that a canvas or callbacks wait on is
        published for the worker to drop (True), rather than answered at publish. A subclass
        whose duplicates raise at publish instead (celery-once's default) says False."""
        return True

    def _finished(self, task_id: str) -> bool:
        """Whether the result backend holds a final state for ``task_id`` (False if unknown)."""
        if self.ignore_result:
            return False
        try:
            return str(self.AsyncResult(task_id).state) in states.READY_STATES
        except Exception:  # no result backend, or it is down: cannot tell
            return False

    def _on_lost_handler(
        self, run: interrupt.Run | None
    ) -> Callable[[Lease, LockLost], None] | None:
        policy = self.on_lock_lost
        if policy == "raise" and run is not None:
            return run.on_lost
        if callable(policy):
            return lambda lease, error: policy(self, lease, error)
        return None

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: Exception | None = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Keep the key until the body has really ended (execution-time mode).

        Celery publishes the retry before raising ``Retry``, and the body may catch that and go
        on, so the key is released as the body ends, not at that publish; a retried run that
        starts before then finds its own task id's run holding the key and is requeued (with
        backoff) until it frees, never run beside it. When Celery publishes
        nothing (retries exhausted: it raises ``MaxRetriesExceededError`` or ``exc`` into the
        body, whose fallback then still runs under the lock) the key stays held. In
        enqueue-time mode the key passes to the retry message as the body ends (a body that
        catches ``Retry`` and goes on keeps it until then; the retry's execution waits).
        ``throw=False`` keeps the key in both modes: the body goes on, and the retry waits for it.
        """
        lease = self.lease
        # throw=False in enqueue-time mode: the body goes on, so the key must not pass to the
        # retry message (its run would take it over while this body still runs); the retry
        # is published without a queued lock and waits for the key like any retry.
        keeping = lease is not None and not throw and self.lock_on == "enqueue"
        if keeping:
            enqueue.retrying.keep = lease
        handing = lease is not None and throw and self.lock_on == "enqueue"
        if handing:
            enqueue.retrying.handing = lease
        try:
            return super().retry(
                args=args,
                kwargs=kwargs,
                exc=exc,
                throw=throw,
                eta=eta,
                countdown=countdown,
                max_retries=max_retries,
                **options,
            )
        finally:
            if keeping:
                enqueue.retrying.keep = None
            if handing:
                enqueue.retrying.handing = None

    def replace(self, sig: Any) -> Any:
        """Celery's ``replace``; in enqueue-time mode a replacement of this same call (same
        task id and key) is handed the key without a gap, as a retry is: the body ends here."""
        lease = self.lease
        handing = lease is not None and self.lock_on == "enqueue"
        if handing:
            enqueue.retrying.handing = lease
        try:
            return super().replace(sig)
        finally:
            if handing:
                enqueue.retrying.handing = None

    # -- duplicates ----------------------------------------------------------------------------

    def _contended(
        self, key: str, exc: LockContended, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        request = self.request
        holder = exc.holder
        if holder is not None and holder.task_id == request.id and not holder.queued:
            # Held by another execution of this very task id.
            delivery = request.delivery_info or {}
            if delivery.get("redelivered") or getattr(request, HEADER_REDELIVERED, None):
                # Another delivery of a task whose execution holds the key: still running (a
                # visibility timeout passed with late acks), or dead with its lease not yet
                # expired (a worker lost with reject_on_worker_lost). Come back when that lease
                # could have run out; then run, unless the result says the first finished.
                wait = exc.retry_after if exc.retry_after is not None else self.lock_requeue_delay
                return self._requeue(HEADER_REDELIVERED, exc, args, kwargs, key=key, delay=wait)
            # A retry that found its predecessor's key not yet released: come back soon.
            return self._requeue(HEADER_REQUEUES, exc, args, kwargs, key=key)
        policy = self.on_duplicate
        if policy == "requeue":
            return self._requeue(HEADER_REQUEUES, exc, args, kwargs, key=key)
        self._signal(key, holder, policy)
        if policy == "drop":
            who = holder.describe() if holder else "another holder"
            return self._drop(
                key, holder, holder.task_id if holder else None, f"{key!r} is held by {who}"
            )
        raise exc  # "raise", or "wait" that ran out

    def _signal(
        self, key: str, holder: Holder | None, policy: str, retry_in: float | None = None
    ) -> None:
        lock_contended.send(
            sender=self,
            key=key,
            token=None,
            task_id=self.request.id,
            holder=holder,
            policy=policy,
            retry_in=retry_in,
        )

    def _drop_marked(self, key: str, duplicate_of: str) -> dict[str, Any]:
        """Drop a message marked a duplicate when it was published (the key was not read)."""
        self._signal(key, None, "drop")
        task_id = self.request.id
        if duplicate_of == task_id:
            # Sent again under the id of the task it duplicates (send_task with a fixed id):
            # store nothing, or this drop's result would stand for that task's own.
            log.info(
                "task %s[%s] dropped: a message of this same task id holds %r and runs instead",
                self.name,
                task_id,
                key,
            )
            raise _explained_ignore(task_id)
        tick = getattr(self.request, HEADER_TICK, None)
        if tick:
            entry = str(tick).rsplit(":", 1)[0]
            why = (
                f"beat already sent this run of {entry!r} as task {duplicate_of} (another send "
                "of the entry holds its tick key, which lasts until the entry's next run)"
            )
        else:
            why = f"published while task {duplicate_of} held {key!r}; that task runs instead"
        return self._drop(key, None, duplicate_of, why)

    def _drop(
        self, key: str, holder: Holder | None, holder_id: str | None, why: str
    ) -> dict[str, Any]:
        log.info("task %s[%s] dropped: %s", self.name, self.request.id, why)
        return {
            "dlock_dropped": True,
            "key": key,
            "holder": holder_id,
            "holder_host": holder.host if holder else None,
            "holder_pid": holder.pid if holder else None,
            "reason": why,
        }

    def _unavailable(
        self, key: str, exc: LockUnavailable, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        if self.on_lock_unavailable == "raise":
            raise exc  # Celery logs the failure, with this message
        return self._requeue(HEADER_UNAVAILABLE, exc, args, kwargs)

    def _requeue(
        self,
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
        request = self.request
        headers = dict(request.headers or {})
        done = int(headers.get(header, 0))
        if done >= self.lock_requeue_max or request.is_eager:
            if header == HEADER_REDELIVERED:
                log.warning(
                    "task %s[%s]: redelivered copy given up after %d requeues: %s",
                    *(self.name, request.id, done, exc),
                )
                raise Ignore()
            raise exc
        if delay is None:
            delay = requeue_delay(done, self.lock_requeue_delay, self.lock_requeue_max_delay)
        else:
            delay = min(delay + 0.05, self.lock_requeue_max_delay)
        if key is not None and isinstance(exc, LockContended):
            self._signal(key, exc.holder, "requeue", retry_in=delay)
        headers[header] = done + 1
        signature = self.signature_from_request(
            request, tuple(args), dict(kwargs), countdown=delay, headers=headers
        )
        Task.apply_async(self, signature.args, signature.kwargs, **signature.options)
        level = logging.WARNING if isinstance(exc, LockUnavailable) else logging.INFO
        log.log(
            level,
            "task %s[%s] requeued in %.2f s (%d of %d): %s",
            self.name,
            request.id,
            delay,
            done + 1,
            self.lock_requeue_max,
            exc,
        )
        raise _explained_ignore(request.id)

    # -- enqueue-time mode ---------------------------------------------------------------------

    #: Set on the drop-in classes, whose own ``apply_async`` calls :meth:`_locked_apply_async`:
    #: a subclass reaching past them (``super(Singleton, self).apply_async(...)``, as with the
    #: peers, to publish a call that must not be locked) gets Celery's own publish here.
    _apply_async_is_celerys: ClassVar[bool] = False

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """In enqueue-time mode, take the key before publishing, or return the holder's result.

        In execution-time mode nothing is taken here: the worker takes the key when the body
        runs, and a retry's execution waits for the body that published it to end (see
        :meth:`retry`).
        """
        if self._apply_async_is_celerys:
            # Marked, so that our before_task_publish receiver leaves it unlocked too; the
            # execution-time lock still keeps its body from running beside another.
            options["headers"] = {**(options.get("headers") or {}), HEADER_QUEUED: 1}
            return Task.apply_async(
                self, args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        return self._locked_apply_async(
            args, kwargs, task_id, producer, link, link_error, shadow, **options
        )

    def _locked_apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """:meth:`apply_async` itself: the drop-in classes call it from their own."""
        if options and not self._peer_options.keys().isdisjoint(options):
            self._refuse_peer_options(
                {n: options[n] for n in self._peer_options if n in options},
                f"task {self.name!r}: apply_async()",
            )
        if self.lock_on != "enqueue" or self.app.conf.task_always_eager:
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        send = super().apply_async
        return enqueue.publish(
            self, send, args, kwargs, task_id, producer, link, link_error, shadow, options
        )


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


def _explained_ignore(task_id: str | None) -> Ignore:
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

_resolve_lock = threading.Lock()
#: Per thread: task instance id -> the leases of its running executions (innermost last).
_running = threading.local()


def _lease_stack(task: SingletonTask) -> list[Lease]:
    try:
        stacks: dict[int, list[Lease]] = _running.stacks
    except AttributeError:  # this thread's first
        stacks = _running.stacks = {}
    stack = stacks.get(id(task))
    if stack is None:  # not setdefault: that would build a list on every call
        stack = stacks[id(task)] = []
    return stack


class _Resolved:
    """A task's lock settings with the app's ``dlock_*`` settings applied; made on first use."""

    def __init__(self, task: SingletonTask) -> None:
        self.manager: Backend = task._lock_manager()
        self.ttl = task.lock_ttl if task.lock_ttl is not None else self.manager.settings.ttl
        self.keys = KeyBuilder(task.name, task.run, task.lock_key, task._unkeyable_fix)
        self._task = task

        self.interval = check_renew_interval(None, self.ttl)
        self._task_limit = task.time_limit or task.app.conf.task_time_limit

    def max_hold(self, request: Any) -> float | None:
        if self._task.lock_max_hold is not None:
            return float(self._task.lock_max_hold)
        limit = (request.timelimit or (None, None))[0] or self._task_limit
        if not limit or interrupt.eventlet():
            # The eventlet pool ignores time limits: the body runs on past the limit, and a
            # lease capped there would let a duplicate run beside it.
            return None
        return float(limit)


#: What Celery's Task itself has (read without getattr: some warn on access).
_TASK_ATTRIBUTES = frozenset(dir(Task))


def check_options(cls: type[SingletonTask]) -> None:
    """Fail at task definition on any bad option, naming the task, the option and the fix."""
    name = getattr(cls, "name", None) or cls.__qualname__
    where = f"task {name!r}"

    def choice(option: str, allowed: tuple[str, ...]) -> None:
        value = getattr(cls, option)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), allowed, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{where}: {option}={value!r} is not one of {', '.join(map(repr, allowed))}.{hint}"
            )

    for attribute in cls.__dict__:
        if attribute in OPTIONS or attribute.startswith("_") or attribute in _TASK_ATTRIBUTES:
            continue
        close = difflib.get_close_matches(attribute, OPTIONS, n=1, cutoff=0.85)
        if close:  # a keyword Celery would keep as a plain attribute, silently ignored
            raise ConfigError(
                f"{where}: {attribute!r} is not a SingletonTask option. Did you mean {close[0]!r}?"
            )
    choice("on_duplicate", POLICIES)
    choice("lock_on", LOCK_ON)
    choice("on_lock_unavailable", ON_UNAVAILABLE)
    if not callable(cls.on_lock_lost):
        choice("on_lock_lost", ON_LOST)
    if cls.lock_ttl is not None:
        check_ttl(f"{where}: lock_ttl", cls.lock_ttl)
    check_seconds(f"{where}: lock_wait", cls.lock_wait)
    check_seconds(f"{where}: lock_requeue_delay", cls.lock_requeue_delay)
    check_seconds(f"{where}: lock_requeue_max_delay", cls.lock_requeue_max_delay)
    check_seconds(f"{where}: lock_queued_ttl", cls.lock_queued_ttl)
    if cls.lock_max_hold is not None:
        check_seconds(f"{where}: lock_max_hold", cls.lock_max_hold)
    if cls.lock_requeue_max_delay < cls.lock_requeue_delay:
        raise ConfigError(
            f"{where}: lock_requeue_max_delay ({cls.lock_requeue_max_delay:g} s) is below "
            f"lock_requeue_delay ({cls.lock_requeue_delay:g} s)."
        )
    limit = cls.lock_requeue_max
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ConfigError(f"{where}: lock_requeue_max must be an int >= 0, got {limit!r}.")
    if cls.on_duplicate == "wait" and cls.lock_on == "enqueue":
        raise ConfigError(
            f"{where}: on_duplicate='wait' does not apply with lock_on='enqueue' (duplicates "
            "are answered with the queued task's result when published)."
        )
    cls._refuse_peer_options(
        {n: getattr(cls, n) for n in cls._peer_options if hasattr(cls, n)}, where
    )
    run = cls.__dict__.get("run")
    if run is not None:
        # Validates lock_key against the signature now, not at the first call: the signature
        # the task is called with, so a method's ``self`` is no argument.
        if isinstance(run, staticmethod):
            signature_of = run.__func__
        elif isinstance(run, classmethod):
            signature_of = functools.partial(run.__func__, cls)
        elif inspect.isfunction(run):  # a method (a class body's, or a bind=True task's)
            signature_of = functools.partial(run, None)
        else:
            signature_of = run
        KeyBuilder(name, signature_of, cls.lock_key)
