"""``SingletonTask``'s options, checked when a task class is created: a misspelt option, a
value not allowed or a lock key that does not fit the task's signature fails at definition,
naming the task, the option and the fix."""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any

from celery import Task

from celery_dlock.celery.keys import KeyBuilder
from celery_dlock.core.config import check_seconds, check_ttl
from celery_dlock.core.errors import ConfigError

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


#: What Celery's Task itself has (read without getattr: some warn on access).
_TASK_ATTRIBUTES = frozenset(dir(Task))


def check_options(cls: Any) -> None:
    """Fail at task definition on any bad option, naming the task, the option and the fix
    (``cls``: a ``SingletonTask`` class)."""
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
