"""``Singleton``: celery-singleton's task base class, on celery_dlock's locks.

Reads what celery-singleton 0.3.1 reads: the task options ``unique_on``,
``raise_on_duplicate`` and ``lock_expiry``, an overridden ``on_duplicate(existing_task_id)``
method, and the app settings ``singleton_backend_url``, ``singleton_raise_on_duplicate`` and
``singleton_lock_expiry``. A duplicate ``.delay()`` returns the ``AsyncResult`` of the task
already queued or running for the key, or raises :class:`DuplicateTaskError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, ClassVar

from celery.utils import uuid

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
from celery_dlock.core.config import check_seconds, settings_from_app
from celery_dlock.core.errors import ConfigError
from celery_dlock.core.registry import manager_for, manager_for_settings

#: celery-singleton's default backend, under the names it can be given by.
_REDIS_BACKENDS = (
    "celery_singleton.backends.redis.RedisBackend",
    "celery_singleton.backends.RedisBackend",
)


class DuplicateTaskError(Exception):
    """A duplicate was published with ``raise_on_duplicate``: ``task_id`` holds the key."""

    def __init__(self, message: str, task_id: str) -> None:
        # Both in args: a result backend (or the prefork pool) rebuilds the exception from
        # them (``DuplicateTaskError(*args)``); celery-singleton's, with the message alone,
        # cannot be rebuilt, and its caller gets an UnpickleableExceptionWrapper.
        super().__init__(message, task_id)
        self.message = message
        self.task_id = task_id

    def __str__(self) -> str:
        return self.message


class SingletonConfig:
    """celery-singleton's app settings as this class reads them (celery-singleton's ``Config``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    @property
    def backend_url(self) -> str | None:
        """``singleton_backend_url``, else a ``redis://`` result backend, else the broker."""
        conf = self.app.conf
        url = conf.get("singleton_backend_url")
        if url is not None:
            return str(url)
        url = conf.get("result_backend")
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://")):
            url = conf.get("broker_url")
        return None if url is None else str(url)

    @property
    def key_prefix(self) -> str:
        """Read for code that shows it; the locks themselves live under ``dlock_prefix``."""
        return str(self.app.conf.get("singleton_key_prefix", "SINGLETONLOCK_"))

    @property
    def raise_on_duplicate(self) -> bool | None:
        value = self.app.conf.get("singleton_raise_on_duplicate")
        return None if value is None else bool(value)

    @property
    def lock_expiry(self) -> float | None:
        value = self.app.conf.get("singleton_lock_expiry")
        return None if value is None else expiry_seconds("singleton_lock_expiry", value)

    def check(self) -> None:
        """Refuse the settings that would need celery-singleton's own backend."""
        conf = self.app.conf
        backend = conf.get("singleton_backend_class")
        if backend is not None and not (
            backend in _REDIS_BACKENDS
            or f"{getattr(backend, '__module__', '')}.{getattr(backend, '__qualname__', '')}"
            in _REDIS_BACKENDS
        ):
            raise ConfigError(
                f"singleton_backend_class={backend!r}: celery_dlock.compat.Singleton keeps its "
                "locks in Redis only; remove the setting and point singleton_backend_url (or "
                "dlock_urls) at a Redis server."
            )
        if conf.get("singleton_backend_kwargs"):
            raise ConfigError(
                f"singleton_backend_kwargs={conf.get('singleton_backend_kwargs')!r} is not read "
                "by celery_dlock.compat.Singleton: put connection options in the URL "
                "(rediss:// for TLS, user:password@ for ACLs) and timeouts in dlock_node_timeout."
            )


def expiry_seconds(name: str, value: Any) -> float:
    """celery-singleton's ``lock_expiry`` in seconds: what redis-py's ``SET ... EX`` takes
    there (an int, a string of digits such as an environment variable, a ``timedelta``), or
    a float; else a ConfigError naming ``name``."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    elif isinstance(value, str) and value.isdigit():
        value = int(value)
    return check_seconds(name, value)


def lock_key_of(unique_on: Any, where: str) -> Any:
    """celery-singleton's ``unique_on`` as a ``lock_key``: None (every argument), one name or
    a list of names; an empty list is the task name alone, as in celery-singleton 0.3.1."""
    if unique_on is None:
        return None
    if isinstance(unique_on, str):
        return [unique_on]
    if isinstance(unique_on, list | tuple) and all(isinstance(n, str) for n in unique_on):
        return list(unique_on)
    raise ConfigError(
        f"{where}: unique_on={unique_on!r} must be None (every argument), an argument name or a "
        "list of argument names, such as unique_on=['username']."
    )


class Singleton(PeerTask):
    """celery-singleton's ``Singleton``: one queued or running task per name and arguments.

    ``.delay()`` takes the key when it publishes; a duplicate publishes nothing and gets the
    holder's ``AsyncResult`` (or :class:`DuplicateTaskError` with ``raise_on_duplicate``).
    Unlike celery-singleton, the key is renewed while the body runs and freed on revoke,
    retry and crash, and the same call spelled positionally or by keyword is one key.
    """

    _key_method = (
        "generate_lock",
        lambda method, task, args, kwargs: method(task, task.name, list(args), dict(kwargs)),
    )
    #: Argument names the key is made of (None: every argument; []: the task name alone).
    unique_on: Any = None
    #: Raise DuplicateTaskError on a duplicate publish; None: ``singleton_raise_on_duplicate``.
    raise_on_duplicate: bool | None = None
    #: Seconds a queued message's key lives; None: ``singleton_lock_expiry``, else
    #: ``lock_queued_ttl``. A running task's key is renewed, whatever this says.
    lock_expiry: float | None = None

    #: Only celery-once's options are refused here; celery-singleton's are read.
    _peer_options: ClassVar[Mapping[str, Callable[[Any], str]]] = {"once": PEER_OPTIONS["once"]}
    _unkeyable_fix = (
        "Key on other arguments with unique_on=[...] (singleton_json_encoder_class is not "
        "read), or pass a value such as the object's id."
    )
    #: A subclass's own ``on_duplicate(existing_task_id)`` method, kept apart from the
    #: ``on_duplicate`` policy option of SingletonTask.
    _duplicate_hook: ClassVar[Callable[[Any, str], Any] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        where = f"task {getattr(cls, 'name', None) or cls.__qualname__!r}"
        hook = cls.__dict__.get("on_duplicate")
        if callable(hook):
            cls._duplicate_hook = hook
            cls.on_duplicate = "drop"  # what a worker does with a marked duplicate
        if "unique_on" in cls.__dict__:
            if "lock_key" in cls.__dict__:
                raise ConfigError(
                    f"{where}: both unique_on={cls.unique_on!r} and lock_key="
                    f"{cls.__dict__['lock_key']!r}; keep one of them."
                )
            cls.lock_key = lock_key_of(cls.unique_on, where)
            if cls.lock_key:
                check_argument_names(cls, f"unique_on={cls.unique_on!r}", cls.lock_key, where)
        if "lock_expiry" in cls.__dict__ and cls.lock_expiry is not None:
            cls.lock_expiry = expiry_seconds(f"{where}: lock_expiry", cls.lock_expiry)
        if cls.raise_on_duplicate not in (None, True, False):
            raise ConfigError(
                f"{where}: raise_on_duplicate={cls.raise_on_duplicate!r} must be True, False or "
                "None (None reads the singleton_raise_on_duplicate setting)."
            )
        super().__init_subclass__(**kwargs)

    # -- celery-singleton's settings -----------------------------------------------------------

    @property
    def singleton_config(self) -> SingletonConfig:
        return SingletonConfig(self.app)

    @property
    def _raise_on_duplicate(self) -> bool:
        if self.raise_on_duplicate is not None:
            return bool(self.raise_on_duplicate)
        return bool(self.singleton_config.raise_on_duplicate)

    def _lock_manager(self) -> Backend:
        """The nodes of ``dlock_urls`` when set, else celery-singleton's URL (see
        :attr:`SingletonConfig.backend_url`), with the app's other ``dlock_*`` settings."""
        config = self.singleton_config
        config.check()
        url = config.backend_url
        if self.app.conf.get("dlock_urls") is not None or url is None:
            return manager_for(self.app)
        if self.app.conf.get("singleton_backend_url") is not None:
            setting = "singleton_backend_url"
        else:
            setting = "the result backend or broker URL (singleton_backend_url is unset)"
        return manager_for_settings(settings_from_app(self.app, ([url], setting)))

    def _queued_ttl(self, options: Mapping[str, Any]) -> float:
        if self.lock_expiry is not None:
            return float(self.lock_expiry)
        expiry = self.singleton_config.lock_expiry
        return expiry if expiry is not None else float(self.lock_queued_ttl)

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
        """Publish, or answer a duplicate as celery-singleton does (see :meth:`on_duplicate`)."""
        if held_by_own_id(self, args, kwargs, options, task_id):
            holder: str | None = task_id
        else:
            holder = eager_holder(self, args, kwargs, options)
        task_id = task_id or uuid()
        if holder is None:
            result = self._locked_apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
            if result.id == task_id:
                return result
            holder = result.id  # merged: another task holds the key
        hook = type(self)._duplicate_hook
        if hook is not None:
            return hook(self, holder)
        return self._answer_duplicate(holder)

    def _answer_duplicate(self, existing_task_id: str) -> Any:
        """celery-singleton's ``on_duplicate``: the holder's result, or DuplicateTaskError."""
        if self._raise_on_duplicate:
            raise DuplicateTaskError(
                f"Attempted to queue a duplicate of task ID {existing_task_id}",
                task_id=existing_task_id,
            )
        return self.AsyncResult(existing_task_id)

    # -- celery-singleton's lock helpers -------------------------------------------------------

    def generate_lock(
        self,
        task_name: str | None = None,
        task_args: Sequence[Any] | None = None,
        task_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The lock key of a call with these arguments (``task_name`` is accepted for
        celery-singleton's signature; the key is always this task's). With ``unique_on=[]``
        the arguments are not read, as in celery-singleton: ``self.release_lock()`` with none
        frees the task's one key."""
        return default_key(self, task_args, task_kwargs)

    def get_existing_task_id(self, lock: str) -> str | None:
        """The id of the task holding ``lock`` (queued or running), or None."""
        holder = self._dlock().manager.holder(lock)
        return None if holder is None else holder.task_id

    def aquire_lock(self, lock: str, task_id: str) -> bool:
        """Take ``lock`` for ``task_id`` as a queued message would; False if it is held.

        (celery-singleton's spelling; :meth:`acquire_lock` is the same.)"""
        from celery_dlock.core.errors import LockContended

        manager = self._dlock().manager
        try:
            lease = manager.acquire(
                lock,
                ttl=self._queued_ttl({}),
                holder=task_id,
                renew=False,
                queued=True,
                sender=self,
            )
        except LockContended:
            return False
        manager.forget(lease)
        return True

    acquire_lock = aquire_lock

    def unlock(self, lock: str) -> None:
        """Force-release ``lock``. A running holder is told it lost the key (and, with the
        default ``on_lock_lost="raise"``, stopped), not left running unaware. Called from the
        body of the task holding ``lock`` (to queue its next run, celery-singleton#53), it
        gives that key back instead: the body goes on without it, as with celery-singleton."""
        if give_back_own(self, lock):
            return
        manager = self._dlock().manager
        holder = manager.holder(lock)
        if holder is not None:
            manager.force_release(lock, holder)

    def release_lock(
        self, task_args: Sequence[Any] | None = None, task_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        """Force-release the key of a call with these arguments (see :meth:`unlock`)."""
        self.unlock(self.generate_lock(self.name, task_args, task_kwargs))


def clear_locks(app: Any) -> list[str]:
    """Free the keys of every queued ``Singleton`` task of ``app``; the keys freed.

    celery-singleton deletes every key under its prefix, to unblock keys left behind by a
    crash. Here a crashed task's key expires by itself ``lock_ttl`` after its last renewal,
    so only queued messages' keys are freed (a duplicate may then be queued, as with
    celery-singleton); a running task keeps its key and is not disturbed. To take a running
    task's key away, use ``task.release_lock(args, kwargs)`` or ``celery dlock release``.
    """
    # One scan per lock manager (per set of nodes), not one per task: a project may have
    # hundreds of Singleton tasks.
    by_manager: dict[int, tuple[Backend, dict[str, Singleton]]] = {}
    for task in list(app.tasks.values()):
        if isinstance(task, Singleton):
            manager = task._dlock().manager
            by_manager.setdefault(id(manager), (manager, {}))[1][task.name] = task
    freed: list[str] = []
    for manager, names in by_manager.values():
        for info in manager.locks(""):
            holder = info.holder
            if holder is None or not holder.queued:
                continue  # free, or held by a running task: left alone
            owner = next((n for n in names if info.key.startswith(f"{n}:")), None)
            if owner is None or holder.task not in (None, owner):
                continue  # not a Singleton task's key
            if manager.force_release(info.key, holder):
                freed.append(info.key)
    return freed
