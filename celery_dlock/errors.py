"""The exceptions celery_dlock raises.

::

    Exception
     └── DLockError            every error of this library; carries the lock's key
          ├── LockContended    another holder has the key (holder info inside)
          ├── LockLost         a held lease is no longer exclusive (reason inside)
          ├── LockUnavailable  Redis unreachable, or no quorum of Redlock nodes answered
          └── ConfigError      bad argument, option, setting or URL (also a ValueError)

``LockContended``, ``LockLost`` and ``LockUnavailable`` are distinct: none subclasses another,
so ``except LockContended`` never swallows a lost lease or an outage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery_dlock.holder import Holder


class DLockError(Exception):
    """Base class of every celery_dlock error; ``key`` names the lock when there is one.

    Every error can be rebuilt from its message alone (as Celery's result backends do when
    a task fails with one), and pickles with its attributes.
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args, self.__dict__)


class LockContended(DLockError):
    """The key is held by someone else and the wait (if any) ran out.

    ``holder`` describes the current holder as read from Redis (task id, host, pid, fencing
    token), or is ``None`` when it released between our attempt and the read.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        holder: Holder | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, key=key)
        self.holder = holder
        #: Seconds until the holder's lease expires if it is not renewed (a hint, not a promise).
        self.retry_after = retry_after


class LockLost(DLockError):
    """A lease that was held is no longer known to be exclusive; ``reason`` says why."""

    def __init__(
        self, message: str, *, key: str | None = None, reason: str = "", token: int | None = None
    ) -> None:
        super().__init__(message, key=key)
        self.reason = reason
        self.token = token


class LockUnavailable(DLockError):
    """Too few Redis nodes answered to decide: Redis down, timeouts, or no Redlock quorum.

    ``errors`` lists ``(node, error)`` pairs, node URLs with any password hidden.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        errors: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message, key=key)
        self.errors = list(errors)


class ConfigError(DLockError, ValueError):
    """An argument, task option, setting or URL is wrong; the message names it and the fix."""
