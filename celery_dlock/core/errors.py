"""The exceptions celery_dlock raises.

::

    Exception
     └── DLockError            every error of this library; carries the lock's key
          ├── LockContended    another holder has the key (holder info inside)
          ├── LockLost         a held lease is no longer exclusive (reason inside)
          ├── LockUnavailable  the lock store unreachable, or too few of its nodes answered
          └── ConfigError      bad argument, option, setting or URL (also a ValueError)

``LockContended``, ``LockLost`` and ``LockUnavailable`` are distinct: none subclasses another,
so ``except LockContended`` never swallows a lost lease or an outage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from celery_dlock.core.holder import Holder


class DLockError(Exception):
    """Base class of every celery_dlock error; ``key`` names the lock when there is one.

    Every error reaches a caller's ``result.get()`` whole: Celery's result backends rebuild an
    exception from its ``args`` alone (JSON, msgpack, YAML) or unpickle it (pickle), so ``args``
    is ``(message, fields)``, the fields (``key``, ``holder``, ...) as plain JSON values, kept in
    step with the attributes. ``str(error)`` is the message.
    """

    #: Attributes carried in ``args`` beside the message.
    _carried: ClassVar[tuple[str, ...]] = ("key",)

    def __init__(
        self, message: str, carried: Mapping[str, Any] | None = None, *, key: str | None = None
    ) -> None:
        super().__init__(message)
        self.key = key
        if carried:  # rebuilt from args by a result backend
            self._restore(carried)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in self._carried:
            fields = {n: _plain(getattr(self, n, None)) for n in self._carried}
            message = self.args[0] if self.args else ""
            # Only fields that say something: a bare error keeps args == (message,).
            told = any(v not in (None, "", []) for v in fields.values())
            self.args = (message, fields) if told else (message,)

    def _restore(self, carried: Mapping[str, Any]) -> None:
        for name in self._carried:
            if name in carried:
                setattr(self, name, carried[name])

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args, self.__dict__)


def _plain(value: Any) -> Any:
    """An attribute as a JSON value (a Holder as its fields, (node, error) pairs as lists)."""
    as_dict = getattr(value, "as_dict", None)
    if callable(as_dict):
        return as_dict()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class LockContended(DLockError):
    """The key is held by someone else and the wait (if any) ran out.

    ``holder`` describes the current holder as read from the lock store (its task id
    ``holder.task_id``, host, pid, fencing token), or is ``None`` when it released between our
    attempt and the read.
    """

    _carried = ("key", "holder", "retry_after")

    def __init__(
        self,
        message: str,
        carried: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        holder: Holder | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.holder = holder
        #: Seconds until the holder's lease expires if it is not renewed (a hint, not a promise).
        self.retry_after = retry_after
        super().__init__(message, carried, key=key)

    def _restore(self, carried: Mapping[str, Any]) -> None:
        super()._restore(carried)
        fields: Any = self.holder
        if isinstance(fields, Mapping):
            from celery_dlock.core.holder import Holder

            try:
                # Keyed as Holder.as_dict writes it (the older names token/holder, which every
                # version reads back).
                self.holder = Holder(**fields)
            except TypeError:  # written by another version: keep what can be read
                self.holder = None


def after_wait(error: LockContended, seconds: float) -> LockContended:
    """``error``, its message saying the caller waited ``seconds`` before it was refused
    ("... (waited 2.0 s)"): a wait that ran out must not read like an immediate refusal."""
    error.args = (f"{error.args[0]} (waited {seconds:.1f} s)", *error.args[1:])
    return error


class LockLost(DLockError):
    """A lease that was held is no longer known to be exclusive; ``reason`` says why."""

    _carried = ("key", "reason", "token")

    def __init__(
        self,
        message: str,
        carried: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        reason: str = "",
        token: int | None = None,
    ) -> None:
        self.reason = reason
        self.token = token
        super().__init__(message, carried, key=key)


class LockUnavailable(DLockError):
    """Too few lock-store nodes answered to decide: a server down, timeouts, or no quorum
    (of Redlock's masters, or of a ZooKeeper ensemble).

    ``errors`` lists ``(node, error)`` pairs, node URLs with any password hidden.
    """

    _carried = ("key", "errors")

    def __init__(
        self,
        message: str,
        carried: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        errors: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.errors = list(errors)
        super().__init__(message, carried, key=key)

    def _restore(self, carried: Mapping[str, Any]) -> None:
        super()._restore(carried)
        self.errors = [(str(node), str(error)) for node, error in self.errors]


class ConfigError(DLockError, ValueError):
    """An argument, task option, setting or URL is wrong; the message names it and the fix."""


# Pickles and Celery's serialized exceptions (``exc_module``) name a class by its module: these
# keep the module that defined them before ``core/`` existed (now a re-export, errors.py), so
# processes of every version load what another wrote.
for _error in (DLockError, LockContended, LockLost, LockUnavailable, ConfigError):
    _error.__module__ = "celery_dlock.errors"
