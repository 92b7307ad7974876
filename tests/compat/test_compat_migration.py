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

import time
from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest
from celery import Celery

from celery_dlock import ConfigError
from celery_dlock.compat import AlreadyQueued, DuplicateTaskError, QueueOnce, Singleton
from tests.support.clients import client
from tests.support.workers import Journal, Worker


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


@pytest.mark.slow
def test_autoretry_for_with_raise_on_duplicate_retries(
    ca: ModuleType, compat_worker: Worker, compat_journal: Journal
) -> None:
    # celery-singleton#55: the retry went through Singleton.apply_async, met its own key and
    # raised DuplicateTaskError; the worker died ("Unrecoverable error: TypeError").
    result = ca.autoretry_raising.delay(7)
    assert result.get(timeout=15) == 7
    starts = compat_journal.select("start", name="singleton-autoretry-7")
    assert [s["retries"] for s in starts] == [0, 1]
    assert {s["id"] for s in starts} == {result.id}
    assert ca.autoretry_raising.delay(7).get(timeout=15) == 7  # the key was freed


class Account:
    """An argument no key can hold (a model instance, say), sent with the pickle serializer."""

    def __init__(self, pk: int) -> None:
        self.pk = pk


def test_an_unkeyable_argument_is_refused_naming_the_peers_option(
    single_urls: list[str],
) -> None:
    # celery-once keys str(value), so it takes any argument; celery-singleton fails with
    # json's TypeError. Ours refuses it at publish, naming the peer's option to use instead
    # (it named SingletonTask's lock_key, which a compat task does not set).
    app = eager_app(single_urls)
    app.conf.task_always_eager = False

    @app.task(base=QueueOnce, serializer="pickle", shared=False)
    def once_task(account: Account) -> None:
        pass

    @app.task(base=Singleton, serializer="pickle", shared=False)
    def singleton_task(account: Account) -> None:
        pass

    with pytest.raises(ConfigError, match=r"Key on other arguments with once=\{'keys': \[") as e:
        once_task.delay(Account(1))
    assert "argument 'account'" in str(e.value)
    assert "lock_key" not in str(e.value)
    with pytest.raises(ConfigError, match=r"Key on other arguments with unique_on=\[") as e:
        singleton_task.delay(Account(1))
    assert "lock_key" not in str(e.value)


def test_apply_beside_a_queued_copy_does_not_run(single_urls: list[str]) -> None:
    # A documented difference: the peers' .apply() runs the body whatever holds the key (and
    # deletes that key as it ends); ours does not run it beside a queued or running copy: it
    # finishes at once with the drop result naming the holder.
    app = eager_app(single_urls)
    app.conf.task_always_eager = False
    ran: list[int] = []

    @app.task(base=QueueOnce, shared=False)
    def once_task(a: int) -> int:
        ran.append(a)
        return a

    once_task.once_backend.raise_or_lock(once_task.get_key((1,), {}), timeout=30)
    dropped = once_task.apply((1,)).get()
    assert ran == []
    assert dropped["dlock_dropped"] is True
    assert once_task.apply((2,)).get() == 2  # a free key: it runs, as with the peers
    with pytest.raises(AlreadyQueued):  # the queued copy's key is still held
        once_task.delay(1)


@pytest.mark.slow
def test_a_task_that_frees_its_own_key_goes_on_and_queues_its_next_run(
    ca: ModuleType, compat_worker: Worker, compat_journal: Journal
) -> None:
    # celery-singleton#53's workaround: self.release_lock() (no arguments: unique_on=[] keys
    # the name alone), then self.apply_async(countdown=...). With celery-singleton the body
    # goes on and its next run is queued. Before: release_lock() raised TypeError (the
    # arguments were bound), and once it took them, the force release stopped the body
    # itself with LockLost at the next renewal.
    first = ca.reschedules_itself.delay(2)
    assert first.get(timeout=15) == 2
    compat_journal.wait_for("end", name="singleton-reschedules-rest", n=0)
    rest = compat_journal.select("end", name="singleton-reschedules-rest")
    assert sorted(e["n"] for e in rest) == [0, 1, 2]
    assert compat_journal.select("interrupted") == []
    last = ca.reschedules_itself.delay(0)  # every run ended: the key is free
    assert last.id != first.id
    assert last.get(timeout=10) == 0


def queued_ttl(task: Any, args: tuple[Any, ...]) -> float:
    info = task._dlock().manager.inspect(task.lock_key_for(args, {}))
    assert info.ttl_left is not None
    return float(info.ttl_left)


def test_lifetime_settings_in_the_forms_the_peers_take(single_urls: list[str]) -> None:
    # celery-singleton passes lock_expiry to redis-py's SET EX, which takes a timedelta or a
    # string of digits (a Django setting read from the environment); celery-once passes
    # timeout to redis-py's Lock, where None means no expiry. Before: each one a ConfigError
    # ("must be a number of seconds"), or (once={'timeout': None}) the default_timeout.
    app = eager_app(single_urls)
    app.conf.task_always_eager = False
    app.conf.singleton_lock_expiry = "120"
    app.conf.ONCE["settings"]["default_timeout"] = None

    @app.task(base=Singleton, shared=False)
    def from_setting(a: int) -> None:
        pass

    @app.task(base=Singleton, lock_expiry=timedelta(minutes=3), shared=False)
    def from_option(a: int) -> None:
        pass

    @app.task(base=QueueOnce, shared=False)
    def once_default(a: int) -> None:
        pass

    @app.task(base=QueueOnce, once={"timeout": None}, shared=False)
    def once_none(a: int) -> None:
        pass

    from_setting.delay(1)
    assert 119 < queued_ttl(from_setting, (1,)) <= 120
    from_option.delay(1)
    assert 179 < queued_ttl(from_option, (1,)) <= 180
    app.conf.singleton_lock_expiry = timedelta(seconds=90)
    from_setting.delay(2)
    assert 89 < queued_ttl(from_setting, (2,)) <= 90
    # celery-once's None (no expiry): a queued key lives lock_queued_ttl here.
    assert once_default.default_timeout is None
    once_default.delay(1)
    assert 599 < queued_ttl(once_default, (1,)) <= 600
    app.conf.ONCE["settings"]["default_timeout"] = 60
    once_none.delay(1)
    assert 599 < queued_ttl(once_none, (1,)) <= 600
    once_default.apply_async((2,), once={"timeout": None})
    assert 599 < queued_ttl(once_default, (2,)) <= 600
    once_default.delay(3)
    assert 59 < queued_ttl(once_default, (3,)) <= 60


def test_a_missing_once_url_is_named_with_the_peers_setting() -> None:
    # celery-once needs ONCE['settings']['url']; ours falls back to a Redis broker. With an
    # AMQP broker the refusal named only dlock_urls, which a celery-once project never set.
    app = Celery("compat_amqp", broker="amqp://guest@127.0.0.1:1//", set_as_current=False)
    app.conf.ONCE = {"backend": "celery_once.backends.Redis", "settings": {}}

    @app.task(base=QueueOnce, shared=False)
    def once_task(a: int) -> None:
        pass

    with pytest.raises(ConfigError, match=r"ONCE\['settings'\]\['url'\] is not set \(ONCE=\{"):
        once_task.delay(1)


def wait_free(task: Any, key: str, timeout: float = 10.0) -> None:
    """Poll until nobody holds ``key`` (a worker releases without waiting for Redis' reply)."""
    deadline = time.monotonic() + timeout
    while task._dlock().manager.holder(key) is not None:
        assert time.monotonic() < deadline, f"{key!r} still held after {timeout} s"
        time.sleep(0.02)


@pytest.mark.slow
def test_an_overridden_key_method_keys_the_lock(
    ca: ModuleType, compat_worker: Worker, compat_journal: Journal
) -> None:
    # The peers' way to a custom key is to override generate_lock (celery-singleton) or
    # get_key (celery-once). Before, the compat classes keyed on every argument whatever the
    # override said: sync_account(1, 0.5) and sync_account(1, 0.6) ran at once.
    first = ca.sync_account.delay(1, 1.0)
    compat_journal.wait_for("start", name="singleton-account-1")
    assert ca.sync_account.delay(account=1, secs=0.1).id == first.id  # one key: the account
    assert first.get(timeout=10) == 1
    wait_free(ca.sync_account, "account-1")  # the worker released the key the override made
    assert ca.sync_account.delay(1, 0.1).get(timeout=10) == 1

    running = ca.once_sync_account.delay(2, 1.0)
    compat_journal.wait_for("start", name="once-account-2")
    with pytest.raises(AlreadyQueued):
        ca.once_sync_account.delay(2, 0.1)
    key = ca.once_sync_account.get_key((2, 0.1))
    assert key == 'by-account-tests.compat_app.once_sync_account:{"account":2,"secs":0.0}'
    assert running.get(timeout=10) == 2
    wait_free(ca.once_sync_account, key)
    assert ca.once_sync_account.delay(2, 0.1).get(timeout=10) == 2
    assert len(compat_journal.select("start", name="singleton-account-1")) == 2
    assert len(compat_journal.select("start", name="once-account-2")) == 2


def test_already_queued_countdown_is_a_valid_retry_after(single_urls: list[str]) -> None:
    # A web view answers AlreadyQueued with Retry-After: int(exc.countdown). celery-once's
    # countdown is never below -0.002 (PTTL of a key gone, in seconds); ours was -1.0 when the
    # holder's key was freed between the refused publish and the look at its ttl (here: the
    # look at a free key), and -1 is no valid Retry-After.
    app = eager_app(single_urls)
    app.conf.task_always_eager = False

    @app.task(base=QueueOnce, shared=False)
    def once_task(a: int) -> None:
        pass

    assert once_task._countdown((1,), {}, {}) == 0.0
    once_task.delay(1)
    with pytest.raises(AlreadyQueued) as queued:
        once_task.delay(1)
    assert int(queued.value.countdown) in range(3590, 3601)


@pytest.mark.slow
def test_a_call_override_that_skips_super_leaves_no_key(
    ca: ModuleType, compat_worker: Worker, compat_journal: Journal
) -> None:
    # Flask's ContextTask pattern put on a compat class (``__call__`` returning self.run(...)
    # in an app context) skips our __call__, which hands the queued key to the run and frees
    # it. The peers free their key in on_success / after_return, which still run. Before, the
    # key was left for the queued lifetime (600 s, 3600 s): every later call was a duplicate
    # of a task that had ended.
    for task in (ca.runs_itself, ca.once_runs_itself):
        assert task.delay(3).get(timeout=10) == 3
        wait_free(task, task.lock_key_for((3,), {}), timeout=5)
        assert task.delay(3).get(timeout=10) == 3


def test_a_deterministic_task_id_published_twice_is_a_duplicate(single_urls: list[str]) -> None:
    # apply_async(task_id=f"sync-{account}") is a common way to name a job once. The peers'
    # key is taken by the first publish, so the second is a duplicate (the existing result,
    # DuplicateTaskError, AlreadyQueued). Before, the second took its own queued lock over
    # (as a retry does) and published a second message with that id: a second run.
    app = eager_app(single_urls)
    app.conf.task_always_eager = False
    broker = client(single_urls[0])

    @app.task(base=Singleton, shared=False)
    def singleton_task(a: int) -> None:
        pass

    @app.task(base=Singleton, raise_on_duplicate=True, shared=False)
    def raising_task(a: int) -> None:
        pass

    @app.task(base=QueueOnce, shared=False)
    def once_task(a: int) -> None:
        pass

    assert singleton_task.apply_async((1,), task_id="sync-1").id == "sync-1"
    assert singleton_task.apply_async((1,), task_id="sync-1").id == "sync-1"
    raising_task.apply_async((1,), task_id="sync-2")
    with pytest.raises(DuplicateTaskError) as duplicate:
        raising_task.apply_async((1,), task_id="sync-2")
    assert duplicate.value.task_id == "sync-2"
    once_task.apply_async((1,), task_id="sync-3")
    with pytest.raises(AlreadyQueued):
        once_task.apply_async((1,), task_id="sync-3")
    assert once_task.apply_async((1,), task_id="sync-3", once={"graceful": True}).id is None
    assert broker.llen("celery") == 3  # one message per id
