"""What both drop-in classes share: the peers' key methods, a publish's own-id check, and
:class:`PeerTask`, the base that frees a queued key a custom ``__call__`` left behind."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from celery_dlock.celery.keys import KeyBuilder
from celery_dlock.celery.task import SingletonTask
from celery_dlock.core.errors import ConfigError, LockUnavailable


class PeerTask(SingletonTask):
    """Enqueue-time ``SingletonTask`` with a peer's overridable key method.

    A subclass names the method and how to call it in ``_key_method``; a class that defines
    its own ``__call__`` gets its leftover queued key freed after each run (see
    :func:`free_leftover`).
    """

    lock_on = "enqueue"
    #: The subclass's own ``apply_async`` locks; past it, Celery's own publish (the peers'
    #: ``super(Singleton, self).apply_async(...)`` opt-out).
    _apply_async_is_celerys = True
    #: The peer's key method and ``call(method, task, args, kwargs)``; see :func:`key_method`.
    _key_method: ClassVar[tuple[str, Callable[..., Any]] | None] = None
    #: A subclass defines its own ``__call__``: see :func:`free_leftover`.
    _own_call: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if "__call__" in cls.__dict__:
            cls._own_call = True
        if cls._key_method is not None and "_key_method" not in cls.__dict__:
            # below Singleton / QueueOnce: a user's class, whose override counts
            key_method(cls, *cls._key_method)
        super().__init_subclass__(**kwargs)

    def after_return(
        self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        super().after_return(status, retval, task_id, args, kwargs, einfo)
        if self._own_call:
            free_leftover(self, args, kwargs, task_id)


def eager_holder(
    task: SingletonTask, args: Any, kwargs: Any, options: Mapping[str, Any]
) -> str | None:
    """Under ``task_always_eager``: the id of the task holding the call's key, else None.

    The peers lock in ``apply_async`` even when Celery runs the task eagerly, so a held key
    makes an eager ``.delay()`` a duplicate (``AlreadyQueued``, ``DuplicateTaskError``, the
    holder's result) as in production. ``SingletonTask`` takes no queued lock under eager
    mode, and its eager run would find the key held and finish at once with a drop result,
    in state ``SUCCESS``. A key held by no task, or Redis unreachable: None (the run's own
    lock decides, as for a publish).
    """
    if not task.app.conf.task_always_eager:
        return None
    key = task._wire_key(args, kwargs, options.get("serializer"))
    try:
        holder = task._dlock().manager.holder(key)
    except LockUnavailable:
        return None
    return None if holder is None else holder.task_id


class PeerKey:
    """The ``lock_key`` of a compat task class that overrides the peer's key method
    (celery-singleton's ``generate_lock``, celery-once's ``get_key``), the peers' way to a key
    of one's own: the lock key is what that method returns, at publish and in the worker.
    ``default`` is the key spec the method's own ``super()`` call computes."""

    def __init__(self, method: Callable[..., Any], default: Any) -> None:
        self.method = method  # (task, args, kwargs) -> str
        self.default = default

    def __get__(self, task: Any, owner: type | None = None) -> Any:
        if task is None:
            return self
        return functools.partial(self.method, task)

    def __call__(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        raise TypeError("a PeerKey is called through its task: task.lock_key(args, kwargs)")


def key_method(cls: Any, name: str, call: Callable[..., Any]) -> None:
    """Make ``cls``'s override of the peer's key method ``name`` (its own, or a base class's)
    the task's lock key; ``call(method, task, args, kwargs)`` calls it."""
    missing = object()
    own = cls.__dict__.get("lock_key", missing)  # set here: by unique_on or once['keys']
    inherited = next(b.__dict__["lock_key"] for b in cls.__mro__[1:] if "lock_key" in b.__dict__)
    method = cls.__dict__.get(name)
    if callable(method):
        if own is not missing:
            default = own
        else:
            default = inherited.default if isinstance(inherited, PeerKey) else inherited
        cls.lock_key = PeerKey(functools.partial(call, method), default)
    elif own is not missing and isinstance(inherited, PeerKey) and not isinstance(own, PeerKey):
        # unique_on / once['keys'] below a class that overrides the key method: the method
        # still makes the key; the new spec is what its super() call computes.
        cls.lock_key = PeerKey(inherited.method, own)


def default_key(task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> str:
    """The key of a call as the compat class makes it without an overridden key method."""
    spec = type(task).lock_key
    if not isinstance(spec, PeerKey):
        if task.lock_key == []:
            return str(task._dlock().keys._named({}))  # the name alone: arguments not read
        return str(task.lock_key_for(args or (), kwargs or {}))
    builder: KeyBuilder | None = task.__dict__.get("_peer_default_keys")
    if builder is None:
        builder = KeyBuilder(task.name, task.run, spec.default, task._unkeyable_fix)
        task.__dict__["_peer_default_keys"] = builder
    if spec.default == []:
        return builder._named({})
    return builder(*builder.sent(args or (), kwargs or {}, task.serializer))


def free_leftover(task: SingletonTask, args: Any, kwargs: Any, task_id: str | None) -> None:
    """After a run of a class whose own ``__call__`` may not call ``super().__call__()`` (the
    Flask ``ContextTask`` pattern: ``return self.run(*args, **kwargs)``): free the queued key
    the message still holds, as the peers' ``on_success``/``after_return`` would. A run that
    went through our ``__call__`` has already passed that key on and freed it: nothing to do.
    """
    if not task_id:
        return
    key = task._dlock().keys(args or (), kwargs or {})
    manager = task._dlock().manager
    try:
        holder = manager.holder(key)
    except LockUnavailable:
        return  # the key expires by itself (lock_queued_ttl)
    if holder is not None and holder.task_id == task_id and holder.queued:
        manager.release_nonce(key, holder.nonce)


def held_by_own_id(
    task: SingletonTask, args: Any, kwargs: Any, options: Mapping[str, Any], task_id: Any
) -> bool:
    """Whether a publish with an explicit ``task_id`` (a deterministic id, not a retry's) finds
    the call's key held by that same id: a message with it is queued or running already.

    The peers refuse it as a duplicate (their key is taken, whoever took it).
    ``SingletonTask`` takes its own queued lock over (what a retry needs) and would publish a
    second message with the id, a second run."""
    if not task_id or options.get("retries"):
        return False
    key = task._wire_key(args, kwargs, options.get("serializer"))
    try:
        holder = task._dlock().manager.holder(key)
    except LockUnavailable:
        return False
    return holder is not None and holder.task_id == task_id


def give_back_own(task: SingletonTask, key: str) -> bool:
    """If the execution running in this thread holds ``key``, give it back (released, not
    lost: the body goes on) and return True."""
    lease = task.lease
    if lease is None or lease.key != key or lease.released:
        return False
    lease.give_back()
    return True


def check_argument_names(cls: type, option: str, names: Sequence[str], where: str) -> None:
    """Refuse argument names the task's function does not take, naming the peer's option
    (``lock_key`` would be named otherwise, which the user did not write)."""
    run = cls.__dict__.get("run")
    if isinstance(run, staticmethod):
        parameters = list(inspect.signature(run.__func__).parameters.values())
    elif inspect.isfunction(run):  # a bind=True task's or a class body's method: skip self
        parameters = list(inspect.signature(run).parameters.values())[1:]
    else:
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    taken = [p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = [n for n in names if n not in taken]
    if unknown:
        raise ConfigError(
            f"{where}: {option} names {unknown[0]!r}, which the task does not take; its "
            f"arguments are {', '.join(taken) or 'none'}."
        )
