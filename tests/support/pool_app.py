"""The tasks of the pool matrix (tests/celery/test_pool_matrix.py), on top of
``tests.support.worker_app``.

Run as ``celery -A tests.support.pool_app worker -P <pool>``: the app, its settings and journal are
``tests.support.worker_app``'s; this module adds bodies that yield (``time.sleep``, green under
gevent and eventlet), bodies that compute without yielding, a task that waits in ``lock()``,
and a trivial locked task for counting connections.
"""

from __future__ import annotations

import time
from typing import Any

from celery_dlock import LockLost, SingletonTask, lock
from tests.support.worker_app import app, record

__all__ = ["app"]

#: The lease length of the matrix's locked bodies: short, so renewal is needed within a row.
TTL = 1.5


@app.task(base=SingletonTask, bind=True, lock_key="pool:{name}", lock_ttl=TTL)
def held(self: Any, name: str, how: str = "sleep", secs: float = 0.5) -> str:
    """Hold ``pool:{name}`` for ``secs``: sleeping in slices ("sleep", which yields to the
    hub on gevent and eventlet), computing without a pause ("spin"), or sleeping then
    raising ("raise"). Records start, end (how it ended) and a ``LockLost`` that reached it."""
    base = {"id": self.request.id, "name": name, "how": how, "token": self.lease.token}
    record("start", **base)
    ended = "returned"
    try:
        end = time.monotonic() + secs
        while time.monotonic() < end:
            if how != "spin":
                time.sleep(min(0.05, max(0.0, end - time.monotonic())))
        if how == "raise":
            raise ValueError(f"{name} failed on purpose")
        return name
    except LockLost:
        record("interrupted", **base)
        ended = "LockLost"
        raise
    except BaseException as exc:
        ended = type(exc).__name__
        raise
    finally:
        record("end", **base, ended=ended, lost=self.lease.lost)


@app.task(bind=True)
def lock_waiter(self: Any, name: str, wait: float) -> int:
    """Wait up to ``wait`` seconds in ``lock()`` for ``pool:{name}``; the fencing token."""
    record("waiting", id=self.request.id, name=name)
    with lock(app, f"pool:{name}", ttl=2 * TTL, wait=wait) as lease:
        record("acquired", id=self.request.id, name=name, token=lease.token)
        return lease.token


@app.task
def ping(name: str) -> str:
    record("ping", name=name)
    return name


@app.task(base=SingletonTask, lock_key="quick:{n}", lock_ttl=5)
def quick(n: int, secs: float = 0.0) -> int:
    """A locked body that sleeps ``secs``: one acquisition and one release per task."""
    time.sleep(secs)
    return n


@app.task(
    base=SingletonTask,
    bind=True,
    lock_key="pool:{name}",
    lock_ttl=TTL,
    on_duplicate="wait",
    lock_wait=30,
)
def waits(self: Any, name: str) -> str:
    """A duplicate of ``pool:{name}`` waits for the key (in its pool process or thread)."""
    record("start", id=self.request.id, name=name, how="waits", token=self.lease.token)
    return name
