"""Enqueue-time locks (``lock_on="enqueue"``): a message takes its key when it is published.

The path of one publish, in the order it runs:

1. ``SingletonTask.apply_async`` calls :func:`publish`. A beat send of a run already sent is
   only labelled a duplicate (:func:`celery_dlock.celery.beat.mark_send`); the worker drops it.
2. :func:`send_queue_lock` sends the queued lock's acquisition without waiting for the reply,
   and leaves it in a thread-local (:class:`EarlyLock`) for the message's task id, so the
   round trip overlaps Celery building the message. Where that is not possible (Redlock,
   Cluster, a key found held a moment ago, a retry of the running execution)
   :func:`queue_lock` takes the lock right away instead, and a duplicate gets the holder's
   ``AsyncResult`` without any message being built.
3. Celery sends ``before_task_publish`` in the same thread; our receiver
   (:mod:`celery_dlock.celery.hooks`) calls :func:`take_early` and :func:`settle_early`, which reads
   the reply through :func:`queue_lock`. If another task holds the key it raises
   :class:`MergedDuplicate` to call the publish off: a ``BaseException``, because Celery's
   signal dispatch logs and swallows every ``Exception`` a receiver raises.
4. Back in :func:`publish`, ``MergedDuplicate`` becomes the holder's ``AsyncResult``; any
   other failure to publish releases the key again, by the acquisition's nonce.

A duplicate whose own task id something else waits on (a group or chord member, a step of a
chain, a call with ``link``/``link_error``) is not called off: it is published marked as the
holder's duplicate, and the worker drops it with the drop result, so the canvas completes and
the callbacks run (:func:`_waited_on`).

Messages published without ``SingletonTask.apply_async`` (``send_task`` by name, a beat
process that did not import the task) reach step 3 with no early acquisition: the receiver
finds the task by name in the sending app (:mod:`celery_dlock.celery.senders`) and
:func:`lock_unlabelled` takes the queued lock, or marks the message a duplicate in its
headers, which the worker then drops without running the body.

A retry of the running execution publishes through the same path: its key is handed over to
the retry message as the body ends (:func:`hand_over_at_exit`), unless ``retry(throw=False)``
keeps the body going.
Any other publish of the key from the body holding it (its own id again, a reschedule) is
neither handed the key nor merged into the run in progress: it is published without a queued
lock and runs once the key is free (:func:`_from_running_body`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from celery import states
from celery.backends.base import DisabledBackend
from celery.utils import uuid

from celery_dlock.celery.beat import mark_send
from celery_dlock.celery.headers import HEADER_DUPLICATE_OF, HEADER_QUEUED, parse_time, queued_ttl
from celery_dlock.core.backend import LOOK_AGAIN, Backend, PendingLease
from celery_dlock.core.errors import LockContended, LockUnavailable
from celery_dlock.core.holder import Holder, head_nonce
from celery_dlock.core.lease import Lease
from celery_dlock.core.signals import lock_contended

# The task's logger: these lines are about its publishes (docs/operations.md lists it).
log = logging.getLogger("celery_dlock.task")
log_release = logging.getLogger("celery_dlock.release")


class _Settings(Protocol):
    @property
    def manager(self) -> Backend: ...


class Publisher(Protocol):
    """What this module needs of a ``SingletonTask`` (which imports this module)."""

    @property
    def name(self) -> Any: ...
    @property
    def backend(self) -> Any: ...
    @property
    def lease(self) -> Lease | None: ...
    def AsyncResult(self, task_id: str) -> Any: ...
    def lock_key_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str: ...
    def _dlock(self) -> _Settings: ...
    def _queued_ttl(self, options: Mapping[str, Any]) -> float: ...
    def _publishes_waited_on_duplicates(self) -> bool: ...
    def _wire_key(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, serializer: Any
    ) -> str: ...


#: Celery's own ``apply_async`` of the task, called as ``send(args, kwargs, task_id, producer,
#: link, link_error, shadow, **options)``.
Send = Callable[..., Any]


def publish(
    task: Publisher,
    send: Send,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    producer: Any,
    link: Any,
    link_error: Any,
    shadow: str | None,
    options: dict[str, Any],
) -> Any:
    """``apply_async`` in enqueue-time mode: take the key and publish, or return the result
    of the task that holds it."""
    task_id = task_id or uuid()
    headers = dict(options.get("headers") or {})
    if mark_send(task, task_id, headers):
        # A beat send for a slot already sent: no queued lock; the worker drops it.
        options["headers"] = headers
        return send(args, kwargs, task_id, producer, link, link_error, shadow, **options)
    wanted = task._wire_key(args, kwargs, options.get("serializer"))
    waited_on = _waited_on(task, link, link_error, options)
    early = send_queue_lock(task, wanted, task_id, options, waited_on)
    key: str | None = wanted  # with early: the reply is read in before_task_publish
    nonce = early.nonce if early is not None else None
    if early is None:
        queued = queue_lock(task, wanted, task_id, options)
        if queued.holder_id is not None:
            if not waited_on or queued.holder_id == task_id:
                return task.AsyncResult(queued.holder_id)
            # Part of a canvas, or with callbacks: its own id must get a result. Published
            # marked as the holder's duplicate, which the worker drops (the drop result).
            options["headers"] = {**headers, HEADER_DUPLICATE_OF: queued.holder_id}
            return send(args, kwargs, task_id, producer, link, link_error, shadow, **options)
        key, nonce = queued.key, queued.nonce
    # The message names its queued lock's acquisition, so that a worker discarding it
    # (revoked, expired) frees that lock and nothing else. Marked even without a queued
    # lock (Redis unreachable): our before_task_publish receiver then leaves it alone.
    options["headers"] = {**headers, HEADER_QUEUED: nonce or 1}
    try:
        return send(args, kwargs, task_id, producer, link, link_error, shadow, **options)
    except MergedDuplicate as merged:  # settle_early called the publish off
        if merged.holder_id != task_id:  # the same id (published again): still wanted
            _unsubscribe(task, task_id)
        return task.AsyncResult(merged.holder_id)
    except BaseException:
        cancel_hand_over(task_id)
        if early is not None:  # the reply may not have been read: the publish failed first
            key = early.finish_quietly()
        if key is not None and nonce is not None:  # not published: free the key again
            task._dlock().manager.release_nonce(key, nonce)
        raise
    finally:
        if early is not None:
            take_early(task_id)


# -- the acquisition sent before the message is built ------------------------------------------


def _waited_on(task: Publisher, link: Any, link_error: Any, options: Mapping[str, Any]) -> bool:
    """Whether something other than the caller waits on this message's own task id: a
    canvas (a group or chord member, any step of a chain) or ``link``/``link_error``
    callbacks. Merged into the holder with nothing published, that id would never get a
    result: the group or chord would never complete, the chain would stop, the callbacks
    never run. A chain's later steps are published by the worker with ``chain=`` given,
    an empty list for the last step, whose id is the chain's result."""
    canvas = "chain" in options or any(options.get(n) for n in ("group_id", "chord"))
    if not (canvas or link or link_error):
        return False
    return task._publishes_waited_on_duplicates()


class EarlyLock:
    """A queued lock's acquisition sent before Celery builds the message, read at publish."""

    def __init__(self, task: Publisher, key: str, pending: PendingLease, waited_on: bool) -> None:
        self.task = task
        self.key = key
        self.pending = pending
        self.taken = False  # set once the reply said this message holds the key
        #: A duplicate is published marked as such, not called off (see :func:`_waited_on`).
        self.waited_on = waited_on

    @property
    def nonce(self) -> str:
        """The acquisition's random nonce: the message carries it."""
        return self.pending.nonce

    def finish_quietly(self) -> str | None:
        """Read the reply if that was not done; the key if this message took it."""
        if not self.taken:
            try:
                self.task._dlock().manager.forget(self.pending.finish())
                self.taken = True
            except Exception:
                pass
        return self.key if self.taken else None


#: Per thread: task id -> the early acquisition of the message being published. Per thread
#: because Celery sends ``before_task_publish`` in the publishing thread.
_early = threading.local()


def _early_locks() -> dict[str, EarlyLock]:
    found: dict[str, EarlyLock] | None = getattr(_early, "locks", None)
    if found is None:
        found = _early.locks = {}
    return found


def take_early(task_id: Any) -> EarlyLock | None:
    """The early acquisition of message ``task_id`` still to be read, if any (removed)."""
    return _early_locks().pop(task_id, None) if task_id else None


#: Keys recently found held at publish: their next publishes check before building a message
#: (a storm of duplicates stays cheap), the others overlap the check with building it.
_held_recently: dict[str, float] = {}
HELD_RECHECK = 1.0


def send_queue_lock(
    task: Publisher, key: str, task_id: str, options: Mapping[str, Any], waited_on: bool = False
) -> EarlyLock | None:
    """Send the queued lock's acquisition without waiting, where that is possible.

    None when the caller must use :func:`queue_lock` instead: Redlock or Cluster, a retry of
    the running execution (its key is handed over), or a key found held less than
    ``HELD_RECHECK`` seconds ago.
    """
    if time.monotonic() - _held_recently.get(key, -math.inf) < HELD_RECHECK:
        return None
    if _running_lease(task, key) is not None:
        return None
    ttl = queued_ttl(task._queued_ttl(options), options)
    pending = task._dlock().manager.send_queued(key, ttl, holder=task_id, sender=task)
    if pending is None:
        return None
    early = EarlyLock(task, key, pending, waited_on)
    _early_locks()[task_id] = early
    return early


# -- in before_task_publish --------------------------------------------------------------------


class MergedDuplicate(BaseException):
    """Calls off the publish of an enqueue-time duplicate from ``before_task_publish``.

    A BaseException because Celery's signal dispatch logs and swallows every ``Exception`` a
    receiver raises; :func:`publish` catches it and returns the holder's result.
    """

    def __init__(self, holder_id: str) -> None:
        super().__init__(holder_id)
        self.holder_id = holder_id


def settle_early(early: EarlyLock, headers: dict[str, Any]) -> None:
    """In ``before_task_publish``: read the early acquisition's reply. The message goes out
    holding the key, goes out without a queued lock (Redis unreachable: logged), or is called
    off with :class:`MergedDuplicate` (another task holds the key)."""
    queued = queue_lock(early.task, early.key, headers["id"], {}, early=early)
    if queued.holder_id is not None:
        if early.waited_on and queued.holder_id != headers["id"]:
            # Published marked as the holder's duplicate, for the worker to drop (a canvas
            # member or a call with callbacks: its own id must get a result).
            headers.pop(HEADER_QUEUED, None)
            headers[HEADER_DUPLICATE_OF] = queued.holder_id
            return
        raise MergedDuplicate(queued.holder_id)


def _unsubscribe(task: Publisher, task_id: str) -> None:
    """Undo the result subscription Celery made for a publish that was called off."""
    try:
        consumer = getattr(task.backend, "result_consumer", None)
        if consumer is not None:
            consumer.cancel_for(task_id)
    except Exception:  # best effort: at worst one idle subscription
        log.debug("could not unsubscribe from the result of %s", task_id, exc_info=True)


def lock_unlabelled(task: Publisher, headers: dict[str, Any], body: Any) -> None:
    """In ``before_task_publish``, for a message of ``task`` that did not come through
    :func:`publish`: take its queued lock, or mark it a duplicate of the holder."""
    if not isinstance(body, tuple | list) or len(body) < 2:
        return
    options = {n: parse_time(headers[n]) for n in ("eta", "expires") if headers.get(n)}
    try:
        wanted = task.lock_key_for(body[0] or (), body[1] or {})
        queued = queue_lock(task, wanted, headers["id"], options)
    except Exception:  # a bad argument fails in the worker with its clear error instead
        log_release.exception(
            "could not take the queued lock for %s[%s]", task.name, headers.get("id")
        )
        return
    if queued.holder_id is not None:
        headers[HEADER_DUPLICATE_OF] = queued.holder_id
    elif queued.key is not None:
        headers[HEADER_QUEUED] = queued.nonce or 1


# -- the queued lock itself --------------------------------------------------------------------


#: Per thread: the lease of the execution whose ``retry()`` is under way (``lease``, so that
#: execution-time mode releases it at the retry's publish), whose ``retry()`` or ``replace()``
#: hands its key to the message (``handing``, enqueue-time mode; ``pending``: the lease and
#: the queued lock's ttl, handed over as the body ends), or whose ``retry(throw=False)``
#: keeps its key (``keep``, enqueue-time mode).
retrying = threading.local()


def _running_lease(task: Publisher, key: str) -> Lease | None:
    """The lease of the execution running in this thread, if it holds ``key``: this publish
    comes from the body holding the key it wants (a retry, a re-publish, a reschedule). Not
    once the body gave it back (``give_back``, celery-singleton's ``unlock`` from the body, to
    queue its next run): that publish takes the key queued like any other."""
    running = task.lease
    if running is not None and running.key == key and not running.released:
        return running
    return None


class Queued(NamedTuple):
    """What :func:`queue_lock` got for a message about to be published."""

    key: str | None  # the key this message now holds, or None
    holder_id: str | None  # the task holding the key instead (a duplicate of it), or None
    nonce: str | None = None  # the queued lock's acquisition nonce, when ``key`` is set


def queue_lock(
    task: Publisher,
    key: str,
    task_id: str,
    options: Mapping[str, Any],
    early: EarlyLock | None = None,
) -> Queued:
    """Take the queued lock on ``key`` for a message about to be published (enqueue-time mode).

    ``key`` set: this message now holds it, by the acquisition ``nonce``. ``holder_id`` set:
    another task holds it (this message is a duplicate of that one). Neither: no lock could be
    taken (Redis unreachable, or a holder that is not a task); publish anyway, the
    execution-time lock still protects the body. With ``early``, the first attempt is that
    acquisition, already sent.
    """
    manager = task._dlock().manager
    ttl = queued_ttl(task._queued_ttl(options), options)
    running = None if early is not None else _running_lease(task, key)
    if running is not None:  # published from the body that holds the key
        return _from_running_body(task, manager, running, key, task_id, ttl)
    first = early.pending if early is not None else None
    looks = _Looks()
    while True:
        try:
            if first is not None:
                sent, first = first, None  # only the first attempt is the one already sent
                queued = sent.finish()
            else:
                # No take-over, not even of a queued lock of this very task id: publishing
                # an id again while its message waits is a duplicate like any other (merged),
                # or the body would run once per message. Its retry's key comes by hand_over.
                queued = manager.acquire(key, ttl=ttl, holder=task_id, renew=False, queued=True)
        except LockUnavailable as exc:
            return _unlocked(task, task_id, exc)
        except LockContended as exc:
            outcome = _after_refusal(task, manager, key, task_id, exc, looks)
            if outcome is None:
                continue
            return outcome
        manager.forget(queued)
        if early is not None:
            early.taken = True
        return Queued(key, None, head_nonce(queued.head))


@dataclass
class _Looks:
    """What one publish has tried so far for its queued lock (the loop of :func:`queue_lock`)."""

    #: The backend's counts of looks again, by reason (:meth:`Backend.duplicate_of`).
    backend: dict[str, int] = field(default_factory=dict)
    #: Whether the holder's task was already checked for a revoke.
    revoked_checked: bool = False


def _after_refusal(
    task: Publisher,
    manager: Backend,
    key: str,
    task_id: str,
    refusal: LockContended,
    looks: _Looks,
) -> Queued | None:
    """What a refused attempt at the queued lock leads to: ``None`` to try again, else what
    the message goes out with (merged into the holder, or without its queued lock)."""
    holder = refusal.holder
    if (
        holder is not None
        and holder.task_id is not None
        and holder.queued
        and not looks.revoked_checked
        and _revoked(task, holder.task_id)
    ):
        # The queued task was revoked before any worker saw it: its lock (that one
        # acquisition, not whatever holds the key by then) is free to go.
        looks.revoked_checked = True
        manager.release_nonce(key, holder.nonce)
        return None
    try:
        # The backend says whom to merge into: it may look again first (a holder not named
        # yet, or one that may still be undone).
        found = manager.duplicate_of(key, refusal, looks.backend, _Results(task))
    except LockUnavailable as exc:
        return _unlocked(task, task_id, exc)
    if found is LOOK_AGAIN:
        return None
    if found is None or found.task_id is None:  # held, but not by a task: publish anyway
        return Queued(None, None)
    return _merged(task, key, task_id, found)


def _unlocked(task: Publisher, task_id: str, why: object) -> Queued:
    """The message goes out without its queued lock (the execution-time lock still holds)."""
    log.warning("task %s[%s] published without its queued lock: %s", task.name, task_id, why)
    return Queued(None, None)


def _from_running_body(
    task: Publisher, manager: Backend, running: Lease, key: str, task_id: str, ttl: float
) -> Queued:
    """A message for ``key`` published by the body whose execution holds ``key``.

    Its own retry (``retry()``, ``replace()``, which end the body at once): the key passes
    to the message without a gap. Anything else leaves the body running, so the key stays
    with it, and the message is not merged into the run in progress either (that run is not
    "queued": the call would be lost): it is published without a queued lock, and its
    execution meets the key like any other. The same task id waits for this run to end
    (requeued with backoff until the key frees); a new id, run before this one ends, meets
    the task's ``on_duplicate`` policy.
    """
    if running.holder == task_id and getattr(retrying, "handing", None) is running:
        # Handed over when this body has really ended (:func:`hand_over_at_exit`), not now: a
        # body that catches the Retry and goes on keeps its key, and the message's execution,
        # finding its own id's run holding it, is requeued until then. The message carries no
        # nonce: a worker discarding it (revoked) leaves its queued lock to a later duplicate,
        # which frees the lock of a task it finds REVOKED, or to its ttl.
        retrying.pending = (running, ttl)
        return Queued(key, None, None)
    if getattr(retrying, "keep", None) is not running:  # retry(throw=False) says so itself
        same = "its own task id" if running.holder == task_id else f"task {task_id}"
        log.info(
            "task %s[%s] publishes %s for %r, the key it holds: not merged into the run in "
            "progress; published without a queued lock, it runs when the key is free",
            task.name,
            running.holder,
            same,
            key,
        )
    return Queued(None, None)


def cancel_hand_over(task_id: str) -> None:
    """The message of a pending hand-over was not published after all: the key stays."""
    pending: tuple[Lease, float] | None = getattr(retrying, "pending", None)
    if pending is not None and pending[0].holder == task_id:
        retrying.pending = None


def hand_over_at_exit(task: Publisher, lease: Lease) -> bool:
    """As the body of ``lease`` ends: pass its key to its retry's (or replacement's) message
    if one was published; True if so (the lease is then ended), else the caller releases."""
    pending: tuple[Lease, float] | None = getattr(retrying, "pending", None)
    if pending is None or pending[0] is not lease:
        return False
    retrying.pending = None
    try:
        task._dlock().manager.hand_over(lease, pending[1])
    except Exception:  # the key then expires, or the message's execution waits for it
        log_release.exception("could not hand %r over to its retry", lease.key)
        return False
    return True


def _merged(task: Publisher, key: str, task_id: str, holder: Holder) -> Queued:
    """This message is a duplicate of ``holder``'s task, which has ``key`` queued or running."""
    if len(_held_recently) > 1000:
        _held_recently.clear()
    _held_recently[key] = time.monotonic()
    lock_contended.send(
        sender=task,
        key=key,
        token=None,
        task_id=task_id,
        holder=holder,
        policy="merge",
        retry_in=None,
    )
    return Queued(None, holder.task_id)


class _Results:
    """What the backend may ask about a holder's task (:class:`TaskResults`): the task's
    result backend, read only when the backend asks (a holder that may still be undone)."""

    def __init__(self, task: Publisher) -> None:
        self.task = task

    def kept(self) -> bool:
        return _results_kept(self.task)

    def ran(self, task_id: str | None) -> bool:
        return _ran(self.task, task_id)


def _results_kept(task: Publisher) -> bool:
    """Whether a caller can wait on the task id a duplicate merges into: the task keeps its
    results where any publisher can read them. Else merging into an attempt undone later
    strands no waiter, and a holder that ran and let the key go could not be told from an
    undone one (its state stays PENDING): a duplicate merges at once, as on a single Redis.
    ``rpc://`` sends a result to the reply queue of the process that sent the task only."""
    if getattr(task, "ignore_result", False):
        return False
    from celery.backends.rpc import RPCBackend  # only where a holder may be undone: kept off import

    try:
        return not isinstance(task.backend, DisabledBackend | RPCBackend)
    except Exception:  # a backend that cannot even be made keeps nothing
        return False


def _ran(task: Publisher, task_id: str | None) -> bool:
    """Whether the result backend has heard of ``task_id`` (it was published and ran)."""
    if task_id is None:
        return False
    try:
        state = str(task.AsyncResult(task_id).state)
    except Exception:  # no result backend, or it is down: not known to have run
        return False
    return state not in (states.PENDING, states.REVOKED)


#: Holder ids recently found not revoked: a storm of duplicates reads the backend once a
#: second per holder, not once per duplicate.
_not_revoked: dict[str, float] = {}
REVOKED_RECHECK = 1.0


def _revoked(task: Publisher, task_id: str) -> bool:
    now = time.monotonic()
    if now - _not_revoked.get(task_id, -math.inf) < REVOKED_RECHECK:
        return False
    try:
        revoked = str(task.AsyncResult(task_id).state) == states.REVOKED
    except Exception:  # no result backend, or it is down: assume not revoked
        revoked = False
    if not revoked:
        if len(_not_revoked) > 1000:
            _not_revoked.clear()
        _not_revoked[task_id] = now
    return revoked
