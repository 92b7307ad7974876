"""celery-once's own test suite, translated to run against ``celery_dlock.compat.QueueOnce``.

Upstream: https://github.com/cameronmaske/celery-once at commit
4f68b6b3c8503b9360179a246521b07315cdf577 (celery-once 3.0.1), files ``tests/unit/test_tasks.py``,
``tests/unit/test_helpers.py``, ``tests/unit/backends/test_redis.py``,
``tests/integration/test_tasks.py``, ``tests/integration/backends/test_redis.py`` and
``tests/integration/flask_app/test_flask.py``. Each test keeps its upstream name and intent.
Upstream runs tasks eagerly against fakeredis or a mocked backend; here the tasks run in a real
``celery worker`` (tests/support/compat_app.py) and every lock is on a real redis-server.

Not translated: ``tests/unit/backends/test_file.py`` (8) and
``tests/integration/backends/test_file.py`` (2) test celery-once's File backend, which
``QueueOnce`` refuses (``test_file_backend_is_refused`` below), and upstream's two Python-2-only
tests (``test_kwargs_to_list_5``, ``test_queue_once_key_unicode_py2``).

Tests marked ``deliberate_difference`` assert our behaviour where it differs on purpose; the
reason is in the marker and in docs/migrating.md. Most are the key's format: celery-once writes
``qo_<task>_<name>-<str(value)>``; ours is ``<task>:<canonical JSON of the bound arguments>``.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

import pytest
from celery import Celery, states

from celery_dlock import ConfigError, admin
from celery_dlock.compat import AlreadyQueued, QueueOnce
from celery_dlock.compat.once import lock_url
from celery_dlock.core.urls import check_urls
from tests.support.workers import Journal, Worker

IDLE = "compat-idle"  # a queue no worker consumes: its messages stay queued, holding their keys
KEY_FORMAT = "the key's format: <task>:<canonical JSON>, not qo_<task>_<name>-<str(value)>"


def deliberate(reason: str) -> Any:
    return pytest.mark.deliberate_difference(reason=reason)


def wait_free(task: Any, key: str, timeout: float = 10.0) -> None:
    """Poll until nobody holds ``key`` (no sleeping a guessed time)."""
    manager = task._dlock().manager
    deadline = time.monotonic() + timeout
    while manager.holder(key) is not None:
        assert time.monotonic() < deadline, f"{key!r} still held after {timeout} s"
        time.sleep(0.02)


@pytest.fixture
def app(ca: ModuleType, compat_journal: Journal) -> Celery:
    """The compat app with every lock freed."""
    result: Celery = ca.app
    return result


# == tests/unit/test_tasks.py: the key of a call ================================================
# Upstream's tasks, on an app of their own (keys are computed, nothing is published).

unit = Celery("unit", broker="redis://127.0.0.1:1/0", set_as_current=False)


@unit.task(name="simple_example", base=QueueOnce, shared=False)
def simple_example() -> str:
    return "simple"


@unit.task(name="bound_task", bind=True, base=QueueOnce, shared=False)
def bound_task(self: Any, a: int, b: int) -> int:
    return a + b


@unit.task(name="args_example", base=QueueOnce, shared=False)
def args_example(a: int, b: int) -> int:
    return a + b


@unit.task(name="select_args_example", base=QueueOnce, once={"keys": ["a"]}, shared=False)
def select_args_example(a: int, b: int) -> int:
    return a + b


@unit.task(name="autoretry_for_example", base=QueueOnce, autoretry_for=(Exception,), shared=False)
def autoretry_for_example(a: int, b: int) -> int:
    return a + b


@unit.task(name="kwargs_example", base=QueueOnce, shared=False)
def kwargs_example(**kwargs: Any) -> None:
    pass


@unit.task(name="éxample", base=QueueOnce, shared=False)
def unicode_example(a: str, b: str) -> None:
    pass


@deliberate(KEY_FORMAT)
def test_get_key_simple() -> None:
    assert simple_example.get_key() == "simple_example:{}"  # upstream: "qo_simple_example"


@deliberate(KEY_FORMAT)
def test_get_key_args_1() -> None:
    assert args_example.get_key(kwargs={"a": 1, "b": 2}) == 'args_example:{"a":1,"b":2}'


@deliberate(KEY_FORMAT)
def test_get_key_args_2() -> None:
    assert args_example.get_key(args=(1, 2)) == 'args_example:{"a":1,"b":2}'


@deliberate(KEY_FORMAT)
def test_get_key_select_args_1() -> None:
    assert select_args_example.get_key(kwargs={"a": 1, "b": 2}) == 'select_args_example:{"a":1}'


@deliberate(KEY_FORMAT)
def test_get_key_bound_task() -> None:
    assert bound_task.get_key(kwargs={"a": 1, "b": 2}) == 'bound_task:{"a":1,"b":2}'


@deliberate(KEY_FORMAT)
def test_get_key_autoretry_for() -> None:
    expected = 'autoretry_for_example:{"a":1,"b":2}'
    assert autoretry_for_example.get_key(kwargs={"a": 1, "b": 2}) == expected


def test_get_call_args() -> None:
    # upstream: _get_call_args binds positional arguments to their names
    assert args_example.get_key((1, 2), {}) == args_example.get_key((), {"a": 1, "b": 2})


def test_get_call_args_bound() -> None:
    # upstream: a bound task's ``self`` is no argument of the key
    assert bound_task.get_key((1, 2), {}) == bound_task.get_key((), {"b": 2, "a": 1})


# == tests/unit/test_helpers.py: celery-once's key helpers ======================================
# force_string, kwargs_to_list and queue_once_key build celery-once's key; here, the key of a
# call with those values. import_backend is ONCE['backend'].


def kw_key(**kwargs: Any) -> str:
    return kwargs_example.get_key((), kwargs)


@pytest.mark.parametrize("value", ["a", "é"], ids=["ascii", "unicode"])
def test_force_string(value: str) -> None:
    # upstream test_force_string_1..4 (str and py2 unicode, ascii and é): kept as given
    assert kw_key(s=value) == f'kwargs_example:{{"kwargs":{{"s":"{value}"}}}}'


@deliberate(KEY_FORMAT)
def test_kwargs_to_list_empty() -> None:
    assert kw_key() == 'kwargs_example:{"kwargs":{}}'


@deliberate(KEY_FORMAT)
def test_kwargs_to_list_1() -> None:
    assert kw_key(int=1) == 'kwargs_example:{"kwargs":{"int":1}}'


@deliberate(KEY_FORMAT)
def test_kwargs_to_list_2() -> None:
    assert kw_key(int=1, boolean=True) == 'kwargs_example:{"kwargs":{"boolean":true,"int":1}}'


@deliberate(KEY_FORMAT)
def test_kwargs_to_list_3() -> None:
    expected = 'kwargs_example:{"kwargs":{"boolean":true,"int":1,"str":"abc"}}'
    assert kw_key(str="abc", int=1, boolean=True) == expected


@deliberate(
    KEY_FORMAT + "; and 1 and '1' in a list are two keys (celery-once's str() makes them one "
    "only where the repr matches)"
)
def test_kwargs_to_list_4() -> None:
    key = kw_key(int=1, boolean=True, str="abc", list=[1, "2"])
    assert key == 'kwargs_example:{"kwargs":{"boolean":true,"int":1,"list":[1,"2"],"str":"abc"}}'
    assert key != kw_key(int=1, boolean=True, str="abc", list=[1, 2])


@deliberate(KEY_FORMAT)
def test_kwargs_to_list_6() -> None:
    key = kw_key(a={"é": "c"}, b=["a", "é"], c=1, d="é", e="é")
    assert key == ('kwargs_example:{"kwargs":{"a":{"é":"c"},"b":["a","é"],"c":1,"d":"é","e":"é"}}')


def test_kwargs_to_list_nested_dict_is_sorted_1() -> None:
    assert kw_key(nested={"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}) == kw_key(
        nested={"e": 5, "d": 4, "c": 3, "b": 2, "a": 1}
    )


def test_kwargs_to_list_nested_dict_is_sorted_2() -> None:
    assert kw_key(nested={"a": {"a": 1, "b": 2}, "c": 2, "b": 3}) == kw_key(
        nested={"b": 3, "c": 2, "a": {"b": 2, "a": 1}}
    )


@deliberate(KEY_FORMAT)
def test_queue_once_key() -> None:
    assert simple_example.get_key() == "simple_example:{}"


@deliberate(KEY_FORMAT)
def test_queue_once_key_kwargs() -> None:
    assert kw_key(pk=10) == 'kwargs_example:{"kwargs":{"pk":10}}'


def test_queue_once_key_kwargs_restrict_keys() -> None:
    assert select_args_example.get_key((10, 1), {}) == select_args_example.get_key((10, 2), {})


def test_queue_once_key_unicode_py3() -> None:
    assert unicode_example.get_key(("é", "é"), {}) == 'éxample:{"a":"é","b":"é"}'


def test_import_backend() -> None:
    fresh = Celery(set_as_current=False, broker="redis://127.0.0.1:1/0")
    fresh.conf.ONCE = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": "redis://h:1/3"},
    }

    @fresh.task(base=QueueOnce, shared=False)
    def t() -> None:
        pass

    assert t._dlock().manager.settings.urls == ("redis://h:1/3",)


@deliberate("locks are kept in Redis only: the File backend (and any other) is refused, named")
def test_file_backend_is_refused() -> None:
    fresh = Celery(set_as_current=False, broker="redis://127.0.0.1:1/0")
    fresh.conf.ONCE = {"backend": "celery_once.backends.File", "settings": {"location": "/tmp"}}

    @fresh.task(base=QueueOnce, shared=False)
    def t() -> None:
        pass

    with pytest.raises(ConfigError, match=r"ONCE\['backend'\]='celery_once.backends.File'"):
        t.apply_async(queue=IDLE)


# == tests/unit/backends/test_redis.py ==========================================================


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://localhost:6379/", "redis://localhost:6379/"),
        ("redis://localhost:6379/3", "redis://localhost:6379/3"),
        ("redis://localhost", "redis://localhost"),
        ("redis://:ohai@localhost:6379", "redis://:ohai@localhost:6379"),
        ("redis+socket:///var/run/redis/redis.sock", "unix:///var/run/redis/redis.sock"),
        (
            "redis+socket:///var/run/redis/redis.sock?db=2&socket_timeout=2",
            "unix:///var/run/redis/redis.sock?db=2&socket_timeout=2",
        ),
        ("rediss://localhost:6379/3", "rediss://localhost:6379/3"),
    ],
    ids=[
        "tcp_default_args",
        "tcp_with_db",
        "tcp_no_port",
        "tcp_with_password",
        "unix_sock_no_options",
        "unix_sock_with_options",
        "with_ssl",
    ],
)
def test_parse_url(url: str, expected: str) -> None:
    assert lock_url(url) == expected
    assert check_urls([lock_url(url)], "ONCE['settings']['url']")  # accepted as a lock URL


def test_parse_unsupported_url() -> None:
    with pytest.raises(ValueError, match="amqp"):  # ConfigError is a ValueError
        check_urls([lock_url("amqp://guest:guest@localhost:5672/potato")])


def test_redis_raise_or_lock(app: Celery, ca: ModuleType) -> None:
    backend = ca.example.once_backend
    assert backend.task._dlock().manager.holder("test") is None
    backend.raise_or_lock(key="test", timeout=60)
    assert backend.task._dlock().manager.holder("test") is not None


def test_redis_raise_or_lock_locked(app: Celery, ca: ModuleType) -> None:
    backend = ca.example.once_backend
    backend.raise_or_lock(key="test", timeout=30)  # upstream: a redis-py Lock of 30 s
    with pytest.raises(AlreadyQueued) as e:
        backend.raise_or_lock(key="test", timeout=60)
    assert e.value.countdown == pytest.approx(30.0, rel=0.1)
    assert "Expires in" in e.value.message


def test_redis_raise_or_lock_locked_and_expired(app: Celery, ca: ModuleType) -> None:
    backend = ca.example.once_backend
    backend.raise_or_lock(key="test", timeout=1)
    wait_free(ca.example, "test")  # upstream: sleep(1)
    backend.raise_or_lock(key="test", timeout=60)
    assert backend.task._dlock().manager.holder("test") is not None


def test_redis_clear_lock(app: Celery, ca: ModuleType) -> None:
    backend = ca.example.once_backend
    backend.raise_or_lock(key="test", timeout=30)
    assert backend.clear_lock("test") is True
    assert backend.task._dlock().manager.holder("test") is None


def test_redis_cached_property(app: Celery, ca: ModuleType) -> None:
    # upstream: the Redis client is made once however often the backend is built
    assert ca.example.once_backend.task._dlock().manager is ca.bound_task._dlock().manager


# == tests/integration/test_tasks.py ============================================================


def test_config(ca: ModuleType) -> None:
    assert ca.example.config == ca.app.conf


def test_once_config(ca: ModuleType) -> None:
    assert ca.example.once_config == {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": ca.LOCKS, "default_timeout": 60},
    }


def test_default_timeout(ca: ModuleType) -> None:
    assert ca.example.default_timeout == 60


def held_for(task: Any, result: Any, args: tuple[Any, ...] = ()) -> float:
    info = admin.show(task._dlock().manager, task.get_key(args, {}))
    assert info.task_id == result.id
    assert info.ttl_left is not None
    return info.ttl_left


def test_apply_async(app: Celery, ca: ModuleType) -> None:
    result = ca.example.apply_async(queue=IDLE)
    assert 55 < held_for(ca.example, result) <= 60  # upstream: raise_or_lock(key, timeout=60)


def test_apply_async_timeout(app: Celery, ca: ModuleType) -> None:
    result = ca.example.apply_async(once={"timeout": 120}, queue=IDLE)
    assert 115 < held_for(ca.example, result) <= 120


def test_raise_already_queued(app: Celery, ca: ModuleType) -> None:
    ca.example.apply_async(queue=IDLE)
    with pytest.raises(AlreadyQueued):
        ca.example.apply_async(queue=IDLE)


def test_raise_already_queued_graceful(app: Celery, ca: ModuleType) -> None:
    ca.example.apply_async(queue=IDLE)
    result = ca.example.apply_async(once={"graceful": True}, queue=IDLE)
    assert result.result is None
    assert result.id is None
    assert result.state == states.REJECTED


def test_retry(app: Celery, ca: ModuleType, compat_worker: Worker, compat_journal: Journal) -> None:
    result = ca.example_retry.apply_async()
    assert result.get(timeout=15) == 1
    starts = compat_journal.select("start", name="example_retry")
    assert [s["retries"] for s in starts] == [0, 1]  # the retry ran
    wait_free(ca.example_retry, ca.example_retry.get_key())  # and the key is free after it


def test_delay_unlock_before_run(
    app: Celery, ca: ModuleType, compat_worker: Worker, compat_journal: Journal
) -> None:
    first = ca.example_unlock_before_run.apply_async((1.5,))
    compat_journal.wait_for("start", name="unlock_before_run")
    # The queued key was freed as the run started: the same call is queued again at once.
    second = ca.example_unlock_before_run.apply_async((1.5,))
    assert second.id != first.id
    assert second.get(timeout=20) is None
    assert first.get(timeout=5) is None
    runs = compat_journal.select("start", name="unlock_before_run")
    assert runs[0]["key"].endswith(":running")
    # celery_dlock: the run holds a key of its own, so the second did not overlap the first
    # (celery-once runs it at once, in parallel).
    ends = compat_journal.select("end", name="unlock_before_run")
    assert runs[1]["t"] >= ends[0]["t"]


# == tests/integration/backends/test_redis.py ===================================================


def test_init(ca: ModuleType) -> None:
    assert ca.example._dlock().manager.settings.urls == (ca.LOCKS,)


def test_delay(app: Celery, ca: ModuleType, compat_worker: Worker) -> None:
    assert ca.example.delay(1).get(timeout=15) == {"a": 1, "held_by_me": True}
    wait_free(ca.example, ca.example.get_key((1,)))


def test_delay_already_queued(app: Celery, ca: ModuleType) -> None:
    ca.example.once_backend.raise_or_lock(ca.example.get_key((1,)), timeout=100)
    with pytest.raises(AlreadyQueued):
        ca.example.delay(1)


def test_delay_expired(app: Celery, ca: ModuleType, compat_worker: Worker) -> None:
    key = ca.example.get_key((1,))
    ca.example.once_backend.raise_or_lock(key, timeout=1)
    wait_free(ca.example, key)
    assert ca.example.delay(1).get(timeout=15) == {"a": 1, "held_by_me": True}
    wait_free(ca.example, key)


def test_apply_async_runs(app: Celery, ca: ModuleType, compat_worker: Worker) -> None:
    # upstream: test_apply_async (of this file)
    assert ca.example.apply_async(args=(1,)).get(timeout=15) == {"a": 1, "held_by_me": True}
    wait_free(ca.example, ca.example.get_key((1,)))


def test_apply_async_queued(app: Celery, ca: ModuleType) -> None:
    ca.example.once_backend.raise_or_lock(ca.example.get_key((1,)), timeout=100)
    with pytest.raises(AlreadyQueued):
        ca.example.apply_async(args=(1,))


def test_already_queued_graceful(app: Celery, ca: ModuleType) -> None:
    ca.example.once_backend.raise_or_lock(ca.example.get_key((1,)), timeout=100)
    result = ca.example.apply_async(args=(1,), once={"graceful": True})
    assert result.result is None


def test_apply_async_expired(app: Celery, ca: ModuleType, compat_worker: Worker) -> None:
    key = ca.example.get_key((1,))
    ca.example.once_backend.raise_or_lock(key, timeout=1)
    wait_free(ca.example, key)
    assert ca.example.apply_async(args=(1,)).get(timeout=15) == {"a": 1, "held_by_me": True}
    wait_free(ca.example, key)


# == tests/integration/flask_app/test_flask.py ==================================================
# README "Flask Integration": a QueueOnce subclass wrapping __call__ (no Flask installed: the
# subclass records that its wrapper ran).


def test_flask(app: Celery, ca: ModuleType, compat_worker: Worker) -> None:
    first = ca.sleep_task.delay(1)
    with pytest.raises(AlreadyQueued):
        ca.sleep_task.delay(1)
    assert first.get(timeout=15) == {"in_context": True, "key": ca.sleep_task.get_key((1,))}
    wait_free(ca.sleep_task, ca.sleep_task.get_key((1,)))  # upstream: sleep(2)
    assert ca.sleep_task.delay(1).get(timeout=15)["in_context"] is True
