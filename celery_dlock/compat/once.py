"""``QueueOnce``: celery-once's task base class, on celery_dlock's locks.

Reads what celery-once 3.0.1 reads: ``app.conf.ONCE = {"backend": ..., "settings": {...}}``
(``url``, ``default_timeout``, ``blocking``, ``blocking_timeout``), the task option
``once={"keys", "timeout", "graceful", "unlock_before_run"}`` and, per call,
``apply_async(..., once={"graceful", "timeout"})``. A duplicate publish raises
:class:`AlreadyQueued`, or with ``graceful`` returns celery-once's id-less ``REJECTED`` result.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from celery import Task, states
from celery.result import EagerResult
from celery.utils import uuid

from celery_dlock.celery.headers import HEADER_QUEUED
from celery_dlock.compat.options import PEER_OPTIONS
from celery_dlock.compat.peer import (
    PeerTask,
    check_argument_names,
    default_key,
    eager_holder,
    give_back_own,
    held_by_own_id,
)
from celery_dlock.core.backend import Backend
from celery_dlock.core.clock import jitter
from celery_dlock.core.config import check_seconds, settings_from_app
from celery_dlock.core.errors import ConfigError, LockContended, LockUnavailable
from celery_dlock.core.registry import manager_for, manager_for_settings

#: celery-once's Redis backend, under the names it can be given by.
_REDIS_BACKENDS = ("celery_once.backends.Redis", "celery_once.backends.redis.Redis")
TASK_OPTIONS = ("graceful", "timeout", "keys", "unlock_before_run")
CALL_OPTIONS = ("graceful", "timeout")
DEFAULT_TIMEOUT = 60 * 60  # celery-once's default_timeout


class AlreadyQueued(Exception):
    """A duplicate was published: ``countdown`` is the seconds until the holder's key expires
    unless renewed (a running task's key is renewed, so it may be held longer)."""

    def __init__(self, countdown: float) -> None:
        self.message = f"Expires in {countdown} seconds"
        self.countdown = countdown
        # args=(countdown,) as celery-once's: a result backend rebuilds the exception from its
        # args (``AlreadyQueued(*args)``), so a task that failed with it gives its caller the
        # countdown back as a number.
        super().__init__(countdown)

    def __str__(self) -> str:
        return self.message


def once_settings(conf: Any) -> Mapping[str, Any]:
    """``ONCE["settings"]``, after checking that ``ONCE["backend"]`` is celery-once's Redis."""
    once = conf.get("ONCE")
    if once is None:
        return {}
    if not isinstance(once, Mapping):
        raise ConfigError(
            f"ONCE={once!r} must be a dict such as {{'backend': 'celery_once.backends.Redis', "
            "'settings': {'url': 'redis://host:6379/0'}}."
        )
    backend = once.get("backend", _REDIS_BACKENDS[0])
    if backend not in _REDIS_BACKENDS:
        raise ConfigError(
            f"ONCE['backend']={backend!r}: celery_dlock.compat.QueueOnce keeps its locks in "
            "Redis only; set ONCE['backend']='celery_once.backends.Redis' with "
            "ONCE['settings']['url'], or set dlock_urls."
        )
    settings = once.get("settings") or {}
    if not isinstance(settings, Mapping):
        raise ConfigError(f"ONCE['settings']={settings!r} must be a dict.")
    return settings


def lock_url(url: Any) -> str:
    """celery-once's URL as a lock URL: its ``redis+socket://`` is our ``unix://``."""
    if not isinstance(url, str):
        raise ConfigError(f"ONCE['settings']['url']={url!r} must be a Redis URL string.")
    if url.startswith("redis+socket://"):
        return "unix://" + url.removeprefix("redis+socket://")
    return url


def _options(value: Any, allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{where}: once={value!r} must be a dict, such as once={{'keys': ['a']}}."
        )
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise ConfigError(
            f"{where}: once={dict(value)!r} has {unknown[0]!r}, which is not one of "
            f"{', '.join(map(repr, allowed))}."
        )
    if value.get("timeout") is not None:
        check_seconds(f"{where}: once['timeout']", value["timeout"])
    return dict(value)


class OnceBackend:
    """What celery-once's ``task.once_backend`` offers, on the task's own lock nodes."""

    def __init__(self, task: QueueOnce) -> None:
        self.task = task

    def raise_or_lock(self, key: str, timeout: float) -> None:
        """Hold ``key`` for ``timeout`` seconds as a queued message would, or raise
        :class:`AlreadyQueued` with the seconds its holder has left."""
        manager = self.task._dlock().manager
        seconds = check_seconds("timeout", timeout)
        try:
            lease = manager.acquire(
                key, ttl=seconds, holder=f"once-{uuid()}", renew=False, queued=True
            )
        except LockContended as exc:
            left = exc.retry_after if exc.retry_after is not None else 0.0
            raise AlreadyQueued(round(left, 3)) from None
        manager.forget(lease)

    def clear_lock(self, key: str) -> bool:
        """Force-release ``key``; a running holder is told it lost it. True if it was held.
        Called from the body of the task holding ``key``, it gives that key back instead (the
        body goes on without it, as with celery-once)."""
        if give_back_own(self.task, key):
            return True
        manager = self.task._dlock().manager
        holder = manager.holder(key)
        return holder is not None and manager.force_release(key, holder)


#: Per thread: the per-call ``once`` options of the publish under way.
_call = threading.local()


class QueueOnce(PeerTask):
    """celery-once's ``QueueOnce``: a duplicate publish raises :class:`AlreadyQueued`.

    The key is taken when the task is published and held until the execution ends (or, with
    ``unlock_before_run``, until it starts). Unlike celery-once, it is renewed while the body
    runs, freed on revoke and crash, and ``send_task`` publishes are deduplicated too.
    """

    _key_method = (
        "get_key",
        lambda method, task, args, kwargs: method(task, list(args), dict(kwargs)),
    )
    #: celery-once's task options: ``keys``, ``timeout``, ``graceful``, ``unlock_before_run``.
    once: ClassVar[Mapping[str, Any]] = {"graceful": False, "unlock_before_run": False}

    #: Only celery-singleton's options are refused here; celery-once's are read.
    _peer_options: ClassVar[Mapping[str, Callable[[Any], str]]] = {
        n: f for n, f in PEER_OPTIONS.items() if n != "once"
    }
    _unkeyable_fix = (
        "celery-once keyed it by str(value); this key needs the value itself. Key on other "
        "arguments with once={'keys': [...]}, or pass a value such as the object's id."
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        where = f"task {getattr(cls, 'name', None) or cls.__qualname__!r}"
        if "once" in cls.__dict__:
            once = _options(cls.__dict__["once"], TASK_OPTIONS, where)
            cls.once = once
            keys = once.get("keys")
            if keys is not None:
                if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
                    raise ConfigError(
                        f"{where}: once['keys']={keys!r} must be a list of argument names, "
                        "such as once={'keys': ['a']}."
                    )
                cls.lock_key = list(keys)
                check_argument_names(cls, f"once['keys']={keys!r}", cls.lock_key, where)
            if once.get("unlock_before_run"):
                # The body runs under a key of its own: a duplicate published meanwhile is
                # queued, and waits (requeued) for the running one to end before it runs.
                cls.on_duplicate = "requeue"
        super().__init_subclass__(**kwargs)

    # -- celery-once's settings ----------------------------------------------------------------

    @property
    def config(self) -> Any:
        return self.app.conf

    @property
    def once_config(self) -> Any:
        return self.app.conf.get("ONCE")

    @property
    def default_timeout(self) -> float | None:
        """``ONCE['settings']['default_timeout']`` (3600 s); None as celery-once takes it (no
        expiry there; here a queued key lives ``lock_queued_ttl``)."""
        value = once_settings(self.app.conf).get("default_timeout", DEFAULT_TIMEOUT)
        if value is None:
            return None
        return check_seconds("ONCE['settings']['default_timeout']", value)

    def unlock_before_run(self) -> bool:
        return bool(self.once.get("unlock_before_run", False))

    def _lock_manager(self) -> Backend:
        settings = once_settings(self.app.conf)
        if self.app.conf.get("dlock_urls") is not None:
            return manager_for(self.app)
        if settings.get("url") is None:
            try:
                return manager_for(self.app)  # the broker, if it is Redis
            except ConfigError as exc:  # it names dlock_urls, which a celery-once user lacks
                raise ConfigError(
                    f"ONCE['settings']['url'] is not set (ONCE={self.app.conf.get('ONCE')!r}) "
                    "and the broker cannot hold the locks: set ONCE['settings']['url'] to the "
                    f"Redis URL celery-once used, such as 'redis://host:6379/0' ({exc})"
                ) from None
        urls = [lock_url(settings["url"])]
        return manager_for_settings(settings_from_app(self.app, (urls, "ONCE['settings']['url']")))

    def _queued_ttl(self, options: Mapping[str, Any]) -> float:
        # As celery-once: the call's timeout, else the task's, else default_timeout, a None
        # met on the way included (celery-once: no expiry; here lock_queued_ttl).
        call: Mapping[str, Any] = getattr(_call, "once", None) or {}
        if "timeout" in call:
            timeout = call["timeout"]
        elif "timeout" in self.once:
            timeout = self.once["timeout"]
        else:
            timeout = self.default_timeout
        return float(timeout) if timeout is not None else float(self.lock_queued_ttl)

    @property
    def once_backend(self) -> OnceBackend:
        """celery-once's backend interface (``raise_or_lock``, ``clear_lock``) on our locks."""
        return OnceBackend(self)

    def get_key(self, args: Any = None, kwargs: Any = None) -> str:
        """The lock key of a call with these arguments (celery-once's ``get_key``). A task
        class that overrides it keys its lock with the override."""
        return default_key(self, args, kwargs)

    # -- publishing ----------------------------------------------------------------------------

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
        """Publish, or raise :class:`AlreadyQueued` (``graceful``: return celery-once's
        ``EagerResult(None, None, "REJECTED")``) when another task holds the key."""
        where = f"task {self.name!r}: apply_async()"
        once = _options(options.pop("once", None), CALL_OPTIONS, where)
        graceful = once.get("graceful", self.once.get("graceful", False))
        if options.get("retries") and self.unlock_before_run():
            # A retry of a run that gave its key up when it started: nothing to take again
            # (celery-once: "any retry of the task won't re-enable the lock").
            return Task.apply_async(
                self, args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        explicit_id = task_id
        task_id = task_id or uuid()
        settings = once_settings(self.app.conf)
        blocking = bool(settings.get("blocking", False))
        wait = settings.get("blocking_timeout", 1) if blocking else 0.0
        if wait is not None:
            wait = check_seconds("ONCE['settings']['blocking_timeout']", wait, allow_zero=True)
        deadline = None if wait is None else time.monotonic() + wait
        pause = 0.01
        _call.once = once
        try:
            while True:
                if (
                    not held_by_own_id(self, args, kwargs, options, explicit_id)
                    and eager_holder(self, args, kwargs, options) is None
                ):
                    result = self._locked_apply_async(
                        args, kwargs, task_id, producer, link, link_error, shadow, **options
                    )
                    if result.id == task_id:
                        return result
                if deadline is not None and time.monotonic() >= deadline:
                    break
                # Blocking mode: look again until the key frees or the wait runs out.
                left = pause if deadline is None else min(pause, deadline - time.monotonic())
                time.sleep(max(0.0, jitter(left / 2, left)))
                pause = min(pause * 2, 0.5)
        finally:
            _call.once = None
        if graceful:
            return EagerResult(None, None, states.REJECTED)  # type: ignore[arg-type]
        raise AlreadyQueued(self._countdown(args, kwargs, options))

    def _publishes_waited_on_duplicates(self) -> bool:
        # graceful: a canvas member or a call with callbacks is published for the worker to
        # drop (celery-once's REJECTED EagerResult has no id a canvas could wait on); else
        # the duplicate raises AlreadyQueued at publish, as with celery-once.
        call: Mapping[str, Any] = getattr(_call, "once", None) or {}
        return bool(call.get("graceful", self.once.get("graceful", False)))

    def _countdown(self, args: Any, kwargs: Any, options: Mapping[str, Any]) -> float:
        """Seconds until the holder's key expires unless renewed; 0 when unknown (freed
        meanwhile, or Redis unreachable): "retry now". Never below 0, so ``Retry-After:
        int(countdown)`` stays a valid header (celery-once's lowest is -0.002, a key gone)."""
        key = self._wire_key(args, kwargs, options.get("serializer"))
        try:
            info = self._dlock().manager.inspect(key)
        except LockUnavailable:
            return 0.0
        return 0.0 if info.ttl_left is None else max(0.0, round(info.ttl_left, 3))

    # -- execution -----------------------------------------------------------------------------

    def _execution_key(self, key: str, request: Any) -> str:
        if not self.unlock_before_run():
            return key
        if request is not None:
            # The queued message's key is freed as the run starts (what unlock_before_run is
            # for), so the next publish is queued; the run itself holds a key of its own.
            nonce = getattr(request, HEADER_QUEUED, None)
            if isinstance(nonce, str):
                self._dlock().manager.release_nonce(key, nonce)
        return key + self._running_suffix()

    def _running_suffix(self) -> str:
        """What a run's key adds to its call's key. After a template's key ``%3Arunning``: no
        value can fill that in (a value's ``%`` is always escaped), where ``'x'``'s
        ``k:x:running`` would be the call ``'x:running'``'s key."""
        return "%3Arunning" if isinstance(self.lock_key, str) else ":running"
