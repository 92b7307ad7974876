"""A team switching to the compat classes by changing only the import: the calls such a
project makes beyond the peers' own tests and READMEs, each answered as the peer answers it.

* A compat exception raised in a task body (a dispatcher task publishing a compat task) is
  the task's failure; its caller's ``.get()`` rebuilds it from the result backend, with its
  fields (``AlreadyQueued.countdown`` a number, ``DuplicateTaskError.task_id``), as
  celery-once's ``AlreadyQueued`` is rebuilt. Real worker.
* Under ``task_always_eager`` (Django test suites) a duplicate of a held key is answered as
  the peers answer it (they lock in ``apply_async`` even then): ``AlreadyQueued``, celery-once's
  ``REJECTED`` result with ``graceful``, ``DuplicateTaskError``, the holder's ``AsyncResult``.
  Real Redis, no worker (Celery runs eager calls in the caller).
"""

from __future__ import annotations

from types import ModuleType

import pytest
from celery import Celery

from celery_dlock.compat import AlreadyQueued, DuplicateTaskError, QueueOnce, Singleton
from tests.workers import Journal, Worker


@pytest.mark.slow
def test_a_compat_exception_raised_in_a_task_comes_back_with_its_fields(
    ca: ModuleType, compat_worker: Worker, compat_journal: Journal
) -> None:
    # celery-once's AlreadyQueued has args (countdown,): a result backend rebuilds it as
    # AlreadyQueued(countdown). Ours had args (message,), so .countdown came back as the string
    # "Expires in N seconds". celery-singleton's DuplicateTaskError cannot be rebuilt at all
    # (the caller gets an UnpickleableExceptionWrapper, without task_id): fixed here too.
    running = ca.once_work.delay(5, 5, 2.0)
    compat_journal.wait_for("start", name="once-5-5")
    with pytest.raises(AlreadyQueued) as queued:
        ca.fan_out.delay("once", 5, 2.0).get(timeout=10)
    assert isinstance(queued.value.countdown, float)
    assert 0 < queued.value.countdown <= 3  # the running task's lease: dlock_ttl=3, renewed
    assert (
        str(queued.value) == queued.value.message == f"Expires in {queued.value.countdown} seconds"
    )

    holder = ca.raising_work.delay(6, 2.0)
    compat_journal.wait_for("start", name="singleton-raising-6")
    with pytest.raises(DuplicateTaskError) as duplicate:
        ca.fan_out.delay("singleton", 6, 2.0).get(timeout=10)
    assert duplicate.value.task_id == holder.id
    assert str(duplicate.value) == f"Attempted to queue a duplicate of task ID {holder.id}"
    assert running.get(timeout=10) == 10
    assert holder.get(timeout=10) == 6


def eager_app(urls: list[str]) -> Celery:
    app = Celery("compat_eager", broker=urls[0], set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        singleton_backend_url=urls[0],
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": urls[0]}},
    )
    return app


def test_eager_duplicates_are_answered_as_the_peers_answer_them(single_urls: list[str]) -> None:
    # Before: the eager run found the key held and finished at once, state SUCCESS, with the
    # drop result {"dlock_dropped": True, ...}: no AlreadyQueued, no DuplicateTaskError.
    app = eager_app(single_urls)

    @app.task(base=QueueOnce, shared=False)
    def once_task(a: int) -> int:
        return a

    @app.task(base=Singleton, shared=False)
    def singleton_task(a: int) -> int:
        return a

    @app.task(base=Singleton, raise_on_duplicate=True, shared=False)
    def raising_task(a: int) -> int:
        return a

    assert once_task.delay(1).get() == 1  # a free key: the task runs, and frees it
    assert once_task.delay(1).get() == 1
    # As if a copy of each call were queued (a worker-side test, say), with the peers' helpers.
    once_task.once_backend.raise_or_lock(once_task.get_key((1,), {}), timeout=30)
    assert singleton_task.aquire_lock(singleton_task.generate_lock(None, (1,)), "the-holder")
    assert raising_task.aquire_lock(raising_task.generate_lock(None, (1,)), "the-holder")

    with pytest.raises(AlreadyQueued) as queued:
        once_task.delay(1)
    assert 29 < queued.value.countdown <= 30
    rejected = once_task.apply_async((1,), once={"graceful": True})
    assert (rejected.id, rejected.state) == (None, "REJECTED")
    assert once_task.delay(2).get() == 2

    assert singleton_task.delay(1).id == "the-holder"  # the holder's AsyncResult
    assert singleton_task.delay(2).get() == 2
    with pytest.raises(DuplicateTaskError) as duplicate:
        raising_task.delay(1)
    assert duplicate.value.task_id == "the-holder"
