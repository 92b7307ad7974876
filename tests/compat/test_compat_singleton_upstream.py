"""celery-singleton's own test suite, translated to run against ``celery_dlock.compat.Singleton``.

Upstream: https://github.com/steinitzu/celery-singleton at commit
4ee161853d82f71d4565be2bd7d81fc6d8bcbded (celery-singleton 0.3.1), files
``tests/test_singleton.py``, ``tests/test_config.py`` and ``tests/test_backends.py``. Each test
keeps its upstream name (class and function) and intent. Upstream mocks Redis calls
(``RedisBackend.lock``, ``util.generate_lock``, ``BaseTask.apply_async``); here every test
runs against a real redis-server, tasks run in a real ``celery worker``
(tests/support/compat_app.py), and a failing publish is a real broker that refuses connections.
Where upstream inspects its backend's Redis keys, these tests read the lock's holder instead (our
keys differ).

Tests marked ``deliberate_difference`` assert our behaviour where it differs on purpose from
the upstream expectation; the reason is in the marker and in docs/migrating.md.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from types import ModuleType
from typing import Any

import pytest
from celery import Celery
from kombu.exceptions import OperationalError

from celery_dlock import ConfigError, admin
from celery_dlock.compat import DuplicateTaskError, Singleton, clear_locks
from celery_dlock.compat.singleton import SingletonConfig
from celery_dlock.testing import free_port
from tests.support.workers import Journal, Worker

IDLE = "compat-idle"  # a queue no worker consumes: its messages stay queued, holding their keys


def deliberate(reason: str) -> Any:
    return pytest.mark.deliberate_difference(reason=reason)


def wait_free(task: Any, lock: str, timeout: float = 10.0) -> None:
    """Poll until nobody holds ``lock`` (upstream slept 0.05 s "for on_success")."""
    deadline = time.monotonic() + timeout
    while task.get_existing_task_id(lock) is not None:
        assert time.monotonic() < deadline, f"{lock!r} still held after {timeout} s"
        time.sleep(0.02)


@pytest.fixture
def app(ca: ModuleType, compat_journal: Journal) -> Celery:
    """The compat app with every lock freed (upstream: ``scoped_app``, FLUSHALL after)."""
    result: Celery = ca.app
    return result


# == tests/test_singleton.py ====================================================================


class TestSimpleTask:
    def test__queue_duplicates__same_id(self, app: Celery, ca: ModuleType) -> None:
        tasks = [ca.simple_task.apply_async(args=[1, 2, 3], queue=IDLE) for _ in range(10)]
        assert set(tasks) == {tasks[0]}

    def test__queue_multiple_uniques__different_ids(self, app: Celery, ca: ModuleType) -> None:
        tasks = [ca.simple_task.apply_async(args=[i, i + 1, i + 2], queue=IDLE) for i in range(5)]
        assert len(set(tasks)) == len(tasks)

    def test__queue_duplicate_after_success__different_ids(
        self, app: Celery, ca: ModuleType, compat_worker: Worker
    ) -> None:
        task1 = ca.simple_task.apply_async(args=[1, 2, 3])
        assert task1.get(timeout=15) == [1, 2, 3]
        wait_free(ca.simple_task, ca.simple_task.generate_lock(None, [1, 2, 3]))
        task2 = ca.simple_task.apply_async(args=[1, 2, 3])
        assert task2.get(timeout=15) == [1, 2, 3]
        assert task1 != task2

    def test__queue_duplicate_after_error__different_ids(
        self, app: Celery, ca: ModuleType, compat_worker: Worker
    ) -> None:
        task1 = ca.fails.apply_async(args=[1, 2, 3])
        with pytest.raises(ca.ExpectedTaskFail):
            task1.get(timeout=15)
        wait_free(ca.fails, ca.fails.generate_lock(None, [1, 2, 3]))
        task2 = ca.fails.apply_async(args=[1, 2, 3], queue=IDLE)
        assert task1 != task2

    def test__get_existing_task_id(self, app: Celery, ca: ModuleType) -> None:
        lock = ca.simple_task.generate_lock("simple_task", task_args=[1, 2, 3])
        assert ca.simple_task.aquire_lock(lock, "test_task_id") is True
        assert ca.simple_task.get_existing_task_id(lock) == "test_task_id"
        # and a publish of those arguments is now a duplicate of that task
        assert ca.simple_task.apply_async(args=[1, 2, 3], queue=IDLE).id == "test_task_id"

    def test__apply_async_fails__lock_cleared(self, app: Celery) -> None:
        task = _task_on_a_dead_broker(app)
        lock = task.generate_lock("simple_task", task_args=[1, 2, 3])
        with pytest.raises(OperationalError):
            task.apply_async(args=[1, 2, 3], retry=False)
        assert task.get_existing_task_id(lock) is None

    def test__apply_async_fails__exception_reraised(self, app: Celery) -> None:
        task = _task_on_a_dead_broker(app)
        with pytest.raises(OperationalError):
            task.apply_async(args=[1, 2, 3], retry=False)

    def test__raise_on_duplicate__raises_duplicate_error(self, app: Celery, ca: ModuleType) -> None:
        t1 = ca.raise_on_duplicate_task.apply_async((1, 2, 3), queue=IDLE)
        with pytest.raises(DuplicateTaskError) as exinfo:
            ca.raise_on_duplicate_task.apply_async((1, 2, 3), queue=IDLE)
        assert exinfo.value.task_id == t1.task_id


def _task_on_a_dead_broker(app: Celery) -> Any:
    """``simple_task`` on an app whose broker refuses connections (upstream: a mocked
    ``BaseTask.apply_async`` raising), locking on the compat app's Redis."""
    dead = Celery("dead", broker=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False)
    dead.conf.singleton_backend_url = app.conf.singleton_backend_url
    dead.conf.broker_connection_retry = False

    @dead.task(base=Singleton, name="simple_task", shared=False)
    def simple_task(*args: Any) -> Any:
        return args

    return simple_task


class TestClearLocks:
    def test__clear_locks(self, app: Celery, ca: ModuleType) -> None:
        queued = [ca.simple_task.apply_async(args=[i], queue=IDLE) for i in range(5)]
        assert len(set(queued)) == 5
        freed = clear_locks(app)
        assert len(freed) == 5
        assert not admin.locks(ca.simple_task._dlock().manager, ca.simple_task.name)


class TestUniqueOn:
    """Upstream asserts the arguments ``util.generate_lock`` was called with (a mock); here
    the key itself, that a call differing only in other arguments is a duplicate, and that
    the task runs in a worker and frees the key."""

    @staticmethod
    def check(task: Any, call: tuple[Any, dict[str, Any]], other: tuple[Any, dict[str, Any]],
              expected_key_args: dict[str, Any], result: int) -> None:  # fmt: skip
        args, kwargs = call
        lock = task.generate_lock(task.name, args, kwargs)
        suffix = json.dumps(expected_key_args, separators=(",", ":"), sort_keys=True)
        assert lock == f"{task.name}:{suffix}"  # {} for the task name alone
        queued = task.apply_async(args, kwargs, queue=IDLE)
        assert task.apply_async(other[0], other[1], queue=IDLE) == queued
        assert clear_locks(task.app) == [lock]
        ran = task.apply_async(args, kwargs)
        assert ran.get(timeout=15) == result
        wait_free(task, lock)

    def test__unique_on_pos_arg__lock_on_unique_args_only(
        self, app: Celery, ca: ModuleType, compat_worker: Worker
    ) -> None:
        self.check(
            ca.unique_on_args_task, ((2, 3, 4, 5), {}), ((2, 9, 4), {}), {"a": 2, "c": 4}, 120
        )

    def test__unique_on_kwargs__lock_on_unique_args_only(
        self, app: Celery, ca: ModuleType, compat_worker: Worker
    ) -> None:
        self.check(
            ca.unique_on_kwargs_task,
            ((2,), {"b": 3, "c": 4, "d": 5}),
            ((7, 3), {"d": 5}),
            {"b": 3, "d": 5},
            120,
        )

    def test__unique_on_empty__lock_on_task_name_only(
        self, app: Celery, ca: ModuleType, compat_worker: Worker
    ) -> None:
        self.check(ca.unique_on_empty_task, ((2,), {"b": 3, "c": 4, "d": 5}), ((9,), {}), {}, 120)

    def test__unique_on_is_string_convertes_to_list(
        self, app: Celery, ca: ModuleType, compat_worker: Worker
    ) -> None:
        self.check(
            ca.unique_on_string_task,
            ((2,), {"b": 3, "c": 4, "d": 5}),
            ((8, 8, 4), {}),
            {"c": 4},
            120,
        )

    def test__unique_on_handles_unspecified_default_args(
        self, app: Celery, ca: ModuleType, compat_worker: Worker
    ) -> None:
        self.check(
            ca.unique_on_default_task, ((2,), {"b": 3, "c": 4}), ((5,), {"d": 4}), {"d": 4}, 96
        )


class TestRaiseOnDuplicateConfig:
    def test__default_false(self, app: Celery) -> None:
        fresh = Celery(set_as_current=False)

        @fresh.task(base=Singleton, shared=False)
        def mytask() -> None:
            pass

        assert mytask._raise_on_duplicate is False

    def test__task_cfg_overrides_app_cfg(self) -> None:
        fresh = Celery(set_as_current=False)
        fresh.config_from_object({"singleton_raise_on_duplicate": False})

        @fresh.task(base=Singleton, raise_on_duplicate=True, shared=False)
        def mytask() -> None:
            pass

        assert mytask._raise_on_duplicate is True
        assert mytask.singleton_config.raise_on_duplicate is False

    def test__app_cfg_used_when_task_cfg_unset(self) -> None:
        fresh = Celery(set_as_current=False)
        fresh.config_from_object({"singleton_raise_on_duplicate": True})

        @fresh.task(base=Singleton, shared=False)
        def mytask() -> None:
            pass

        assert mytask._raise_on_duplicate is True


class TestLockExpiry:
    def test__lock_expiry__sent_to_backend(self, app: Celery, ca: ModuleType) -> None:
        result = ca.expiring_task.apply_async((1, 2, 3), queue=IDLE)
        lock = ca.expiring_task.generate_lock(ca.expiring_task.name, task_args=[1, 2, 3])
        info = admin.show(ca.expiring_task._dlock().manager, lock)
        assert info.task_id == result.task_id
        assert info.ttl_left is not None
        assert 55 < info.ttl_left <= 60


class MyJSONEncoder(json.JSONEncoder):
    def default(self, obj: Any) -> Any:
        if isinstance(obj, uuid.UUID):
            return str(obj)
        return obj


@pytest.mark.parametrize(
    "singleton_json_encoder_class",
    [MyJSONEncoder, "tests.compat.test_compat_singleton_upstream.MyJSONEncoder"],
    ids=["class", "path"],
)
class TestCustomJSONEncoder:
    @pytest.fixture
    def encoder_app(self, app: Celery, singleton_json_encoder_class: Any) -> Any:
        app.conf.singleton_json_encoder_class = singleton_json_encoder_class
        yield app
        app.conf.singleton_json_encoder_class = None

    @deliberate(
        "a UUID argument needs no JSON encoder: the key is made from the arguments as the "
        "message carries them, and Celery's JSON serializer carries UUIDs"
    )
    def test__queue_fails_with_non_string_value(self, encoder_app: Celery, ca: ModuleType) -> None:
        encoder_app.conf.singleton_json_encoder_class = None
        args = [uuid.uuid4(), uuid.uuid4(), uuid.uuid4()]
        # upstream: TypeError "Object of type UUID is not JSON serializable"
        tasks = [ca.simple_task.apply_async(args=args, queue=IDLE) for _ in range(10)]
        assert set(tasks) == {tasks[0]}

    def test__json_queue_duplicates__same_id(self, encoder_app: Celery, ca: ModuleType) -> None:
        args = [uuid.uuid4(), uuid.uuid4(), uuid.uuid4()]
        tasks = [ca.simple_task.apply_async(args=args, queue=IDLE) for _ in range(10)]
        assert set(tasks) == {tasks[0]}

    @deliberate(
        "singleton_json_encoder_class is not read: a UUID and its string are different "
        "arguments to the task (the worker receives one or the other), so they are two keys"
    )
    def test__queue_duplicates__same_id__via_marshall(
        self, encoder_app: Celery, ca: ModuleType
    ) -> None:
        args = [uuid.uuid4(), uuid.uuid4(), uuid.uuid4()]
        as_uuid = ca.simple_task.apply_async(args=args, queue=IDLE)
        as_str = ca.simple_task.apply_async(args=[str(a) for a in args], queue=IDLE)
        assert as_uuid != as_str  # upstream: the same task, whichever spelling
        mixed = [random.choice([str, lambda s: s])(a) for a in args]
        first = ca.simple_task.apply_async(args=mixed, queue=IDLE)
        assert ca.simple_task.apply_async(args=mixed, queue=IDLE) == first  # one spelling: one key

    def test__queue_multiple_uniques__different_ids(
        self, encoder_app: Celery, ca: ModuleType
    ) -> None:
        tasks = [
            ca.simple_task.apply_async(args=[uuid.uuid4(), uuid.uuid4()], queue=IDLE)
            for _ in range(5)
        ]
        assert len(set(tasks)) == len(tasks)


# == tests/test_config.py =======================================================================


class TestBackendUrl:
    """The URL the locks go to when ``dlock_urls`` is unset (read as celery-singleton does)."""

    def test__defaults_to_celery_backend_url(self) -> None:
        app = Celery(set_as_current=False, backend="redis://test_backend_url")
        assert SingletonConfig(app).backend_url == "redis://test_backend_url"

    def test__defaults_to_celery_broker_url(self) -> None:
        app = Celery(set_as_current=False, broker="redis://test_broker_url")
        assert SingletonConfig(app).backend_url == "redis://test_broker_url"

    def test__override_url(self, app: Celery, ca: ModuleType) -> None:
        config = SingletonConfig(app)
        assert config.backend_url == app.conf.singleton_backend_url
        # and the locks are really there (the compat app sets no dlock_urls)
        manager = ca.simple_task._dlock().manager
        assert manager.settings.urls == (app.conf.singleton_backend_url,)


class FakeBackendModule:
    class FakeBackend:
        pass


class TestBackend:
    def test__default_backend_class__redis_backend(self, app: Celery) -> None:
        fresh = Celery(set_as_current=False, broker="redis://127.0.0.1:1/0")
        fresh.conf.singleton_backend_class = "celery_singleton.backends.redis.RedisBackend"
        SingletonConfig(fresh).check()  # accepted: it is what the locks are kept in anyway

    @deliberate("locks are kept in Redis only: another backend class is refused, named")
    def test__override_from_string__returns_class(self) -> None:
        fresh = Celery(set_as_current=False)
        fresh.conf.singleton_backend_class = "singleton_backends.fake.FakeBackend"
        with pytest.raises(ConfigError, match="singleton_backend_class='singleton_backends"):
            SingletonConfig(fresh).check()

    @deliberate("locks are kept in Redis only: another backend class is refused, named")
    def test__override_from_class__returns_class(self) -> None:
        fresh = Celery(set_as_current=False)
        fresh.conf.singleton_backend_class = FakeBackendModule.FakeBackend
        with pytest.raises(ConfigError, match="Redis only"):
            SingletonConfig(fresh).check()


class TestKeyPrefix:
    def test__default_key_prefix(self) -> None:
        assert SingletonConfig(Celery(set_as_current=False)).key_prefix == "SINGLETONLOCK_"

    @deliberate("singleton_key_prefix is read but the locks live under dlock_prefix")
    def test__override_key_prefix(self, app: Celery, ca: ModuleType) -> None:
        fresh = Celery(set_as_current=False)
        fresh.conf.singleton_key_prefix = "CUSTOM_KEY_PREFIX"
        assert SingletonConfig(fresh).key_prefix == "CUSTOM_KEY_PREFIX"
        lock = ca.simple_task.generate_lock(None, [1])
        assert not lock.startswith(SingletonConfig(app).key_prefix)


class TestRaiseOnDuplicate:
    @pytest.mark.parametrize("value", [True, False], ids=["true_is_true", "false_is_false"])
    def test__value(self, value: bool) -> None:
        fresh = Celery(set_as_current=False)
        fresh.conf.singleton_raise_on_duplicate = value
        assert SingletonConfig(fresh).raise_on_duplicate is value

    def test__default_is_none(self) -> None:
        assert SingletonConfig(Celery(set_as_current=False)).raise_on_duplicate is None


class TestTaskExpiry:
    def test__has_config_value(self) -> None:
        fresh = Celery(set_as_current=False)
        fresh.conf.singleton_lock_expiry = 60
        assert SingletonConfig(fresh).lock_expiry == 60

    def test__default_is_none(self) -> None:
        assert SingletonConfig(Celery(set_as_current=False)).lock_expiry is None


# == tests/test_backends.py =====================================================================
# Upstream tests celery-singleton's RedisBackend (lock, unlock, get, clear) and get_backend.
# There is no backend class here; its operations are the task's lock helpers.


class TestLock:
    def test__new_lock__is_set(self, app: Celery, ca: ModuleType) -> None:
        lock, task_id = ca.simple_task.generate_lock(None, [str(uuid.uuid4())]), str(uuid.uuid4())
        ca.simple_task.aquire_lock(lock, task_id)
        assert ca.simple_task.get_existing_task_id(lock) == task_id

    def test__new_lock__returns_true(self, app: Celery, ca: ModuleType) -> None:
        lock = ca.simple_task.generate_lock(None, [str(uuid.uuid4())])
        assert ca.simple_task.aquire_lock(lock, str(uuid.uuid4())) is True

    def test__lock_exists__is_not_set(self, app: Celery, ca: ModuleType) -> None:
        lock, first, second = ca.simple_task.generate_lock(None, [1]), "first-id", "second-id"
        ca.simple_task.aquire_lock(lock, first)
        ca.simple_task.aquire_lock(lock, second)
        assert ca.simple_task.get_existing_task_id(lock) == first

    def test__lock_exists__returns_false(self, app: Celery, ca: ModuleType) -> None:
        lock = ca.simple_task.generate_lock(None, [1])
        ca.simple_task.aquire_lock(lock, "first-id")
        assert ca.simple_task.aquire_lock(lock, "second-id") is False


class TestUnlock:
    def test__unlock__deletes_key(self, app: Celery, ca: ModuleType) -> None:
        lock = ca.simple_task.generate_lock(None, [1])
        ca.simple_task.aquire_lock(lock, "an-id")
        ca.simple_task.unlock(lock)
        assert ca.simple_task.get_existing_task_id(lock) is None


class TestClear:
    def test__clear_locks__all_gone(self, app: Celery, ca: ModuleType) -> None:
        locks = [ca.simple_task.generate_lock(None, [i]) for i in range(10)]
        for lock in locks:
            ca.simple_task.aquire_lock(lock, str(uuid.uuid4()))
        assert sorted(clear_locks(app)) == sorted(locks)
        for lock in locks:
            assert ca.simple_task.get_existing_task_id(lock) is None


class TestGetBackend:
    """Upstream: ``get_backend(config)`` builds the configured class once, with the URL and
    ``singleton_backend_kwargs``. Here: the lock manager of the configured URL, once."""

    @deliberate("locks are kept in Redis only: a backend class of one's own is refused")
    def test__correct_class(self) -> None:
        fresh = Celery(set_as_current=False)
        fresh.conf.singleton_backend_class = FakeBackendModule.FakeBackend
        with pytest.raises(ConfigError, match="singleton_backend_class"):
            SingletonConfig(fresh).check()

    @deliberate("singleton_backend_kwargs is refused, naming where its options go (the URL)")
    def test__receives_kwargs(self) -> None:
        fresh = Celery(set_as_current=False)
        fresh.conf.singleton_backend_kwargs = {"a": 1, "b": 2, "c": 3}
        with pytest.raises(ConfigError, match=r"singleton_backend_kwargs=.*put connection"):
            SingletonConfig(fresh).check()

    def test__receives_url_as_first_arg(self, app: Celery, ca: ModuleType) -> None:
        manager = ca.simple_task._dlock().manager
        assert manager.settings.urls == (app.conf.singleton_backend_url,)

    def test__get_backend_twice_returns_same_instance(self, app: Celery, ca: ModuleType) -> None:
        assert ca.simple_task._dlock().manager is ca.unique_on_args_task._dlock().manager
