"""Under freezegun's ``freeze_time`` (standing still, or ticking), on every backend:
``lock()``, a ``SingletonTask`` run eagerly and one run by the embedded worker neither hang
nor spin. A wait ends after its length even when the clock it is counted on stands still;
renewals do not race a frozen clock. docs/testing.md says what a frozen clock moves.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from freezegun import freeze_time

from celery_dlock import LockContended, SingletonTask, lock
from celery_dlock.core.clock import real_clock
from celery_dlock.core.registry import forget

STORES = ("memory", "single", "redlock5", "zookeeper")
TICKING = pytest.mark.parametrize("tick", [False, True], ids=["frozen", "ticking"])
_tables = itertools.count()


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> list[str]:
    if request.param == "memory":
        return [f"memory://freeze-{next(_tables)}"]
    fixture = {"single": "single_urls", "redlock5": "redlock_urls"}.get(
        request.param, "zookeeper_urls"
    )
    urls: list[str] = request.getfixturevalue(fixture)
    return urls


@pytest.fixture
def app(store: list[str]) -> Iterator[Celery]:
    made = Celery("freeze", broker="memory://", backend="cache+memory://", set_as_current=False)
    made.conf.dlock_urls = store
    made.conf.dlock_ttl = 5
    yield made
    forget(made)


def _job(app: Celery) -> Any:
    @app.task(base=SingletonTask, bind=True, name="freeze.job", lock_key="job:{n}", shared=False)
    def job(self: Any, n: int) -> int:
        self.lease.ensure()
        return int(self.lease.token)

    return job


@TICKING
def test_lock_and_a_bounded_wait(store: list[str], tick: bool) -> None:
    begun = real_clock()
    with freeze_time("2026-01-01 12:00:00", tick=tick), lock(store, "fz", ttl=5) as lease:
        lease.ensure()
        waited = real_clock()
        with pytest.raises(LockContended):
            lock(store, "fz", wait=0.3).acquire()
        # Ended by its own length in real time, not by the holder's 5 s ttl.
        assert real_clock() - waited < 3
    assert real_clock() - begun < 5


@TICKING
def test_an_eager_singleton_task(app: Celery, tick: bool) -> None:
    job = _job(app)
    with freeze_time("2026-01-01 12:00:00", tick=tick):
        first = job.apply(args=(1,)).get()
        with lock(app, "job:1", ttl=5, holder="other"):
            dropped = job.apply(args=(1,)).result
        second = job.apply(args=(1,)).get()
    assert dropped["dlock_dropped"] is True
    assert second > first


def test_the_embedded_worker_under_a_ticking_clock(app: Celery) -> None:
    """The embedded worker started, used and stopped inside ``freeze_time(tick=True)``.

    Only a ticking clock: under a clock that stands still, or with a freeze_time window
    opened while it runs, Celery's embedded worker does not stop (its shutdown times out),
    with or without celery_dlock; docs/testing.md says so."""
    job = _job(app)
    begun = real_clock()
    with (
        freeze_time("2026-01-01 12:00:00", tick=True),
        start_worker(app, pool="threads", concurrency=2, perform_ping_check=False),
    ):
        results = [job.delay(n) for n in (1, 2)]
        tokens = [r.get(timeout=10) for r in results]
    assert real_clock() - begun < 30
    assert all(isinstance(t, int) for t in tokens)
