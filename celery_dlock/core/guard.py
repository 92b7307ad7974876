"""``celery_dlock.lock()``: a distributed lock for any critical section, as ``with`` or decorator.

::

    with celery_dlock.lock(app, f"meta:{source}:{entity}", ttl=10, wait=5) as lease:
        lease.ensure()              # right before touching the protected resource
        write(row, fence=lease.token)

The backend for an app or URL list is made once and shared (see :mod:`registry`), so
calling ``lock()`` often costs no new connections.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from celery_dlock.core.config import check_key, check_renew_interval, check_seconds, check_ttl
from celery_dlock.core.errors import ConfigError, LockContended, after_wait
from celery_dlock.core.lease import Lease, LostCallback
from celery_dlock.core.registry import backend_for
from celery_dlock.core.signals import lock_contended

if TYPE_CHECKING:
    from celery_dlock.core.backend import Backend

P = ParamSpec("P")
R = TypeVar("R")


#: The options :func:`lock` gives every guard.
_LOCK_OPTIONS = {"holder", "interval", "max_hold", "on_lost"}


class LockGuard:
    """What :func:`lock` returns: enter it for a :class:`Lease`, or decorate a function."""

    # Slots for the options read per acquire; ``__dict__`` and ``__weakref__`` kept, as before
    # the slots: users set attributes on a guard (mock.patch.object in their tests) and keep
    # weak references to it.
    __slots__ = (
        "__dict__",
        "__weakref__",
        "_backend",
        "_held",
        "_holder",
        "_interval",
        "_key",
        "_max_hold",
        "_on_lost",
        "_options",
        "_ttl",
        "_wait",
    )

    def __init__(
        self,
        manager: Backend,  # the name it always had: callers may pass it by keyword
        key: str,
        ttl: float,
        wait: float | None,
        options: dict[str, Any],
    ) -> None:
        self._backend = manager
        self._key = key
        self._ttl = ttl
        self._wait = wait
        self._holder: str | None = options.get("holder")
        self._interval: float | None = options.get("interval")
        self._max_hold: float | None = options.get("max_hold")
        self._on_lost: LostCallback | None = options.get("on_lost")
        # lock()'s four options are passed as plain keywords; any other set (a guard built
        # directly, with more or fewer keys) goes through as given, as it always did.
        self._options = None if options.keys() == _LOCK_OPTIONS else options
        # The leases entered, per thread (a decorated function may run in several at once,
        # and re-enter itself). A dict keyed by thread, not a threading.local, which costs
        # more per lock() call (benchmarks/README.md, "Figures behind the code's constants").
        self._held: dict[int, list[Lease]] = {}

    def acquire(self) -> Lease:
        """Take the lease now (the arguments were checked when the lock was defined)."""
        begun = time.monotonic() if self._wait else 0.0
        try:
            if self._options is not None:
                return self._backend.acquire_checked(
                    self._key, self._ttl, self._wait, **self._options
                )
            return self._backend.acquire_checked(
                self._key,
                self._ttl,
                self._wait,
                holder=self._holder,
                interval=self._interval,
                max_hold=self._max_hold,
                on_lost=self._on_lost,
            )
        except LockContended as exc:
            if self._wait:
                after_wait(exc, time.monotonic() - begun)
            lock_contended.send(
                sender=None,
                key=self._key,
                token=None,
                task_id=self._holder,
                holder=exc.holder,
                policy="raise" if not self._wait else "wait",
                retry_in=None,
            )
            raise

    def __enter__(self) -> Lease:
        lease = self.acquire()
        self._held.setdefault(threading.get_ident(), []).append(lease)
        return lease

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        thread = threading.get_ident()
        stack = self._held[thread]
        lease = stack.pop()
        if not stack:  # a thread id is reused once its thread ends: keep no empty lists
            del self._held[thread]
        lease.__exit__(exc_type, exc, tb)

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(func)
        def locked(*args: P.args, **kwargs: P.kwargs) -> R:
            with self:
                return func(*args, **kwargs)

        return locked

    def __repr__(self) -> str:
        return f"<lock {self._key!r} ttl={self._ttl} wait={self._wait} on {self._backend!r}>"


def lock(
    app_or_urls: Any,
    key: str,
    ttl: float | None = None,
    wait: float | None = 0.0,
    *,
    holder: str | None = None,
    renew: bool = True,
    renew_interval: float | None = None,
    max_hold: float | None = None,
    on_lost: LostCallback | None = None,
) -> LockGuard:
    """A distributed lock on ``key``, as a context manager (yielding the lease) or decorator.

    ``app_or_urls`` is a Celery app (its ``dlock_urls`` and other ``dlock_*`` settings) or a
    list of URLs as ``dlock_urls`` takes them: one for a single Redis (or Sentinel, Cluster, or
    a ZooKeeper ensemble), three or more for Redlock. ``ttl`` defaults
    to ``dlock_ttl`` (30 s) and is renewed every ``renew_interval`` (ttl/3) while held.
    ``wait=0`` raises :class:`LockContended` at once when the key is held, ``wait=s`` waits up
    to ``s`` seconds (woken by the release, not by polling), ``wait=None`` waits for good.
    ``max_hold`` bounds the total time renewals may keep the key. ``on_lost(lease, error)``
    runs when the lease is lost. Leaving the block after the lease was lost raises
    :class:`LockLost` (unless the block is already raising).

    Arguments are checked here, so a bad one fails where the lock is defined.
    """
    backend = backend_for(app_or_urls)
    check_key(key)
    settings = backend.settings
    ttl = settings.ttl if ttl is None else check_ttl("ttl", ttl, settings.drift_factor)
    if not renew:
        interval = None
    elif renew_interval is None:
        interval = ttl / 3.0  # check_renew_interval's default, without the call
    else:
        interval = check_renew_interval(renew_interval, ttl, settings.drift_factor)
    if wait is not None and (type(wait) is not float or not 0.0 <= wait < math.inf):
        wait = check_seconds("wait", wait, allow_zero=True)  # a float in range passes as is
    if max_hold is not None:
        max_hold = check_seconds("max_hold", max_hold)
    if holder is not None and not isinstance(holder, str):
        raise ConfigError(f"holder must be a str (a task id) or None, not {holder!r}.")
    options = {"holder": holder, "interval": interval, "max_hold": max_hold, "on_lost": on_lost}
    return LockGuard(backend, key, ttl, wait, options)
