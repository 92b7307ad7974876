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

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from celery import Task, states

from celery_dlock.celery import duplicates, enqueue, interrupt, senders
from celery_dlock.celery.headers import (
    HEADER_DUPLICATE_OF,
    HEADER_QUEUED,
    HEADER_REDELIVERED,
)
from celery_dlock.celery.keys import UNKEYABLE_FIX, KeyBuilder
from celery_dlock.celery.options import check_options
from celery_dlock.core.backend import Backend
from celery_dlock.core.config import check_renew_interval
from celery_dlock.core.errors import (
    ConfigError,
    LockContended,
    LockLost,
    LockUnavailable,
    after_wait,
)
from celery_dlock.core.lease import Lease
from celery_dlock.core.registry import manager_for

log = logging.getLogger("celery_dlock.task")

LostHandler = Callable[["SingletonTask", Lease, LockLost], None]


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
    #: What a task does when the lock store is unreachable as it starts: "requeue" (with
    #: backoff, up to ``lock_requeue_max`` times, then fail with LockUnavailable) or "raise"
    #: (fail at once).
    on_lock_unavailable: str = "requeue"

    #: Options of celery-singleton and celery-once that this class does not read, each with
    #: what to write instead. Left in a half-migrated task they would be ignored without a
    #: word, so they are refused, per task and per call (:meth:`_refuse_peer_options`). The
    #: table is :data:`celery_dlock.compat.options.PEER_OPTIONS`, set on import of that module.
    _peer_options: ClassVar[Mapping[str, Callable[[Any], str]]] = {}
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
            senders.register_enqueue_task(cls.name, app)
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
            return duplicates.drop_marked(self, key, duplicate_of)
        key = self._execution_key(key, request)
        # Started before the acquire: the lease's loss handler needs the run to interrupt.
        run = interrupt.start() if self.on_lock_lost == "raise" else None
        lease: Lease | None = None
        try:
            try:
                lease = self._acquire(resolved, key, request, run)
            except LockContended as exc:
                return duplicates.contended(self, key, exc, args, kwargs)
            except LockUnavailable as exc:
                return duplicates.unavailable(self, key, exc, args, kwargs)
            if getattr(request, HEADER_REDELIVERED, None) and self._finished(request.id or ""):
                duplicates.skip_finished(self, key, lease, request.id)
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
