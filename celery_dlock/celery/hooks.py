"""Our receivers of Celery's signals: in workers, but also in publishers and beat processes.

Connected when ``celery_dlock`` is imported, so they exist in the worker's parent process
(task modules are imported there before the pool forks), in every publisher and in beat:

* ``task_revoked`` (worker parent): a task killed by ``revoke(terminate=True)`` cannot release
  its lease, and a discarded message (revoked, expired) never takes over its queued lock.
  Releases name one acquisition by its nonce, never a task id, which a redelivered copy or a
  retry shares with the execution that may still run. A terminated execution's lease is
  released once its pool process has really ended (:mod:`celery_dlock.celery.children`): the signal
  may not end it. A discarded message frees only the queued lock it names in its headers.
* ``before_task_publish`` (publishers): step 3 of the enqueue-time publish path
  (:mod:`celery_dlock.celery.enqueue`): the queued lock's reply is read, and a duplicate's publish
  called off; a message that did not come through ``SingletonTask.apply_async`` takes its
  queued lock here, or is marked a duplicate.
* ``before_task_publish`` (beat processes): a scheduled SingletonTask's send takes its tick
  key, or is marked as a duplicate of the send that has it (see :mod:`celery_dlock.celery.beat`).
* ``worker_process_shutdown`` (pool child): release whatever the process still holds.
* ``celeryd_after_setup`` (worker parent, before it consumes): a lock configuration that can
  never work (a wrong scheme, a misspelt ``dlock_*`` setting, a bad value) stops the worker
  with exit status 1, each problem logged, instead of a worker that fails every SingletonTask.
  ``beat_init`` (beat, before its first send) does the same for beat.
* ``worker_init`` (worker parent, before the pool starts): a lock store that cannot serve
  this worker's pool refuses it (``memory://`` and a prefork pool of several processes):
  the worker exits with the :class:`ConfigError`'s message instead of running unguarded.
* ``worker_ready`` (worker parent): one line saying where the locks are, or one warning when
  the lock nodes cannot be reached, instead of every task finding out by itself and being
  requeued for minutes. An unreachable node may come back: the worker runs on.

Not a signal: Celery's own printing of the settings (``celery report``, the worker's answer to
``celery inspect conf``) hides a setting by its name (``PASS``, ``SECRET``, ``broker_url``,
``*backend*``); ``dlock_urls`` is none of those, so :func:`_hide_lock_passwords` has it
shown through :func:`~celery_dlock.core.urls.redact` too.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING, Any

import celery.app.utils
from celery.platforms import EX_FAILURE
from celery.signals import (
    beat_init,
    before_task_publish,
    celeryd_after_setup,
    task_revoked,
    worker_init,
    worker_process_shutdown,
    worker_ready,
)

from celery_dlock.celery import children
from celery_dlock.celery.beat import Tick, current_tick, mark_send
from celery_dlock.celery.enqueue import lock_unlabelled, settle_early, take_early
from celery_dlock.celery.headers import HEADER_DUPLICATE_OF, HEADER_QUEUED, REQUEUE_HEADERS
from celery_dlock.celery.senders import enqueue_app
from celery_dlock.celery.task import SingletonTask
from celery_dlock.core.errors import ConfigError
from celery_dlock.core.renewal import watchdog
from celery_dlock.core.urls import backend_module, redact
from celery_dlock.ops import admin

if TYPE_CHECKING:
    from celery_dlock.core.backend import Backend

log = logging.getLogger("celery_dlock.release")
# Named for where it logs (at worker start); docs/operations.md lists it under this name.
log_start = logging.getLogger("celery_dlock.worker")


@task_revoked.connect
def release_revoked(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    **_: Any,
) -> None:
    if not isinstance(sender, SingletonTask) or request is None or not request.id:
        return
    try:
        # The arguments as the pool process keyed them (deserialized), not lock_key_for's.
        key = sender._dlock().keys(request.args or (), request.kwargs or {})
        manager = sender._dlock().manager
        what = f"terminated task {sender.name}[{request.id}]"
        if terminated:
            execution_key = sender._execution_key(key, None)
            _release_when_ended(manager, execution_key, request.id, what)
            _withdraw_when_ended(manager, execution_key, request.id, what)
        queued = getattr(request, HEADER_QUEUED, None)
        if isinstance(queued, str) and manager.release_nonce(key, queued):
            # Messages of older versions carry 1, not a nonce: their queued lock expires.
            log.info("released %r queued by revoked task %s[%s]", key, sender.name, request.id)
    except Exception:  # never break the worker's revoke handling
        log.exception("could not release the lock of revoked task %s", request.id)


def _release_when_ended(manager: Any, key: str, task_id: str, what: str) -> None:
    """Release the lease of ``task_id``'s execution on this worker once its process ended."""
    holder = manager.holder(key)
    if (
        holder is None
        or holder.task_id != task_id
        or holder.queued
        or holder.host != socket.gethostname()
    ):
        return  # not held by an execution of this task on this host: not ours to release
    if not children.release_when_ended(manager, key, holder, what):
        log.info("%s: %r is held by pid %d, not a process of this worker", what, key, holder.pid)


def _withdraw_when_ended(manager: Backend, key: str, task_id: str, what: str) -> None:
    """Take ``task_id``'s place in line for ``key`` away once its process ended, on a backend
    whose waiters have places (ZooKeeper: a killed waiter's node would otherwise hold up every
    waiter behind it until its session expires; a Redis waiter leaves nothing behind)."""
    for waiter in manager.line(key)[1:]:
        if waiter.task_id == task_id and not waiter.queued and waiter.host == socket.gethostname():
            children.release_when_ended(manager, key, waiter, what, still_there=_in_line)


def _in_line(manager: Backend, key: str, nonce: str) -> bool:
    return any(h.nonce == nonce for h in manager.line(key))


@before_task_publish.connect
def lock_published(
    sender: Any = None,
    headers: Any = None,
    body: Any = None,
    properties: Any = None,
    **_: Any,
) -> None:
    if not headers:
        return
    tick = current_tick()
    if tick is not None:
        _claim_tick(tick, sender, headers)
    early = take_early(headers.get("id"))
    if early is not None:  # SingletonTask.apply_async sent the queued lock's acquisition
        settle_early(early, headers)  # may call the publish off (a duplicate)
        return
    if HEADER_QUEUED in headers or HEADER_DUPLICATE_OF in headers:
        return
    if any(name in headers for name in REQUEUE_HEADERS):
        # A worker's requeue of a message without either header (one sent by a process without
        # celery_dlock): the worker decided already. Locked now it would be marked a duplicate
        # of the very execution it waits for (a redelivered copy of a dead process's run), and
        # the worker would drop it: the call lost.
        return
    reply_to = properties.get("reply_to") if isinstance(properties, dict) else None
    task = _enqueue_task(sender, reply_to)
    if task is not None:  # send_task by name, or a beat process that did not import the task
        lock_unlabelled(task, headers, body)


def _claim_tick(tick: Tick, name: Any, headers: dict[str, Any]) -> None:
    """A beat send of a SingletonTask: take its tick key, or mark it a duplicate."""
    task = tick.app.tasks.get(name)
    if isinstance(task, SingletonTask) and headers.get("id"):
        mark_send(task, headers["id"], headers)


def _enqueue_task(name: Any, reply_to: Any) -> SingletonTask | None:
    """The sending app's enqueue-time task ``name`` (the app told by ``reply_to``), or None."""
    app = enqueue_app(name, reply_to)
    if app is None:
        return None
    # The registry itself, not ``app.tasks``: that would finalize the app as a side effect.
    task = app._tasks.get(name)
    if isinstance(task, SingletonTask) and task.lock_on == "enqueue":
        return task
    return None


@worker_process_shutdown.connect
def release_held(**_: Any) -> None:
    for lease in watchdog.leases():
        lease.release()


@celeryd_after_setup.connect
def refuse_impossible_config(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """Stop a starting worker whose lock settings can never work: its SingletonTasks would
    all fail, and a misspelt setting would put the locks where the user did not mean."""
    _refuse_impossible_config(getattr(instance, "app", None), "worker")


@beat_init.connect
def refuse_impossible_beat_config(sender: Any = None, **_: Any) -> None:
    """The same for a starting beat: each send of a SingletonTask would fail to take its tick
    key (and an enqueue-time lock) and go out unlabelled, to workers that refuse to start."""
    _refuse_impossible_config(getattr(sender, "app", None), "beat")


def _refuse_impossible_config(app: Any, what: str) -> None:
    if app is None:
        return
    try:
        report = admin.check(app, reach=False)
    except Exception:  # a diagnosis that fails is no reason to refuse a worker
        log_start.exception("celery_dlock: could not check the lock settings")
        return
    if report.ok or not (report.tasks or _mentions_locks(app)):
        return  # fine, or an app that does not use celery_dlock's settings at all
    for problem in report.problems:
        log_start.critical("celery_dlock: %s", problem)
    log_start.critical(
        "celery_dlock: the %s stops: its lock settings cannot work (fix the above; "
        "`celery -A <app> dlock check` checks them without starting a worker).",
        what,
    )
    raise SystemExit(EX_FAILURE)  # Celery's worker (and beat) stops with this status


def _mentions_locks(app: Any) -> bool:
    """Whether the app has a setting named as one of ours, or meant to be (``dlock_*``, with
    the app's namespace or Django's ``CELERY_`` before it); another library's ``redlock_*``
    is not one."""
    namespace = getattr(app, "namespace", None) or ""
    prefix = f"{namespace.rstrip('_')}_".lower() if namespace else ""
    try:
        names = [str(name).lower() for name in app.conf]
    except Exception:  # a configuration that cannot list its keys
        return False
    return any(
        name.removeprefix(prefix).removeprefix("celery_").startswith("dlock_") for name in names
    )


@worker_ready.connect
def say_where_locks_are(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        report = admin.check(app)
    except Exception:  # never keep a worker from starting over a diagnosis
        log_start.exception("celery_dlock: could not check the lock nodes")
        return
    if not report.tasks:
        return  # no SingletonTask here: nothing of ours to say
    for warning in report.warnings:
        log_start.warning("celery_dlock: %s.", warning)
    urls = ", ".join(url for url, _ in report.nodes)
    if report.ok:
        log_start.info("celery_dlock: %d singleton task(s); locks on %s", len(report.tasks), urls)
        return
    if not report.nodes:  # the settings themselves are wrong (a worker stopped at setup)
        effect = "every SingletonTask fails with ConfigError until they are fixed"
    elif report.quorum_reached:
        effect = "locks still work with the nodes that answered"
    else:
        effect = (
            "until they answer, SingletonTasks cannot take their locks: each is requeued with "
            "backoff up to lock_requeue_max times, or fails at once with "
            "on_lock_unavailable='raise'"
        )
    problems = "; ".join(p.rstrip(".") for p in report.problems)
    log_start.warning("celery_dlock: %s. So %s.", problems, effect)


@worker_init.connect
def refuse_unfit_pool(sender: Any = None, **_: Any) -> None:
    """Ask the backend of the worker's ``dlock_urls`` whether it can serve this pool (a
    backend module's optional ``check_worker(urls, pool, concurrency)``); exit if not.

    Celery logs and swallows a receiver's exception, so a ``ConfigError`` alone would let the
    worker run its tasks unguarded: the refusal is a ``SystemExit`` carrying its message.
    """
    app = getattr(sender, "app", None)
    urls = app.conf.get("dlock_urls") if app is not None else None
    if not urls:
        return  # the broker's Redis, or no settings: every pool is fine
    urls = [urls] if isinstance(urls, str) else urls
    try:
        check = getattr(backend_module(urls), "check_worker", None)
    except Exception:  # bad settings: worker_ready reports them
        return
    if check is None:
        return
    pool = getattr(sender, "pool_cls", None)
    name = pool if isinstance(pool, str) else getattr(pool, "__module__", "") or ""
    try:
        check(urls, name, getattr(sender, "concurrency", None))
    except ConfigError as exc:
        log_start.critical("celery_dlock: %s", exc)
        raise SystemExit(f"celery_dlock: ConfigError: {exc}") from exc


def _hide_lock_passwords() -> None:
    """Have Celery's settings filter (``celery report``, ``celery inspect conf``) show each
    ``dlock_urls`` URL (``CELERY_DLOCK_URLS`` under Django too) with its password as ``***``.

    Celery looks the filter up by its module name at each call, so it is wrapped there, once.
    """
    original: Any = celery.app.utils.filter_hidden_settings
    if getattr(original, "hides_lock_passwords", False):
        return

    def filter_hidden_settings(conf: Any) -> Any:
        shown = original(conf)
        for name, value in list(shown.items()):
            if isinstance(name, str) and name.lower().endswith("dlock_urls"):
                if isinstance(value, str):
                    shown[name] = redact(value)
                elif isinstance(value, list | tuple):
                    shown[name] = [redact(url) for url in value]
                elif value is not None:
                    shown[name] = "********"  # Celery's mask: not a URL or a list of them
        return shown

    filter_hidden_settings.hides_lock_passwords = True  # type: ignore[attr-defined]
    celery.app.utils.filter_hidden_settings = filter_hidden_settings


_hide_lock_passwords()
