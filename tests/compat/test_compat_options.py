"""The compat classes' options beyond the peers' own tests: bad values get a clear error
naming the option, the value and the fix; celery-once's blocking publish; an overridden
celery-singleton ``on_duplicate`` method. Real Redis; nothing here needs a worker."""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery import Celery

from celery_dlock import ConfigError
from celery_dlock.compat import AlreadyQueued, QueueOnce, Singleton, clear_locks

IDLE = "compat-idle"


def make_app(urls: list[str] | None = None, **conf: Any) -> Celery:
    url = urls[0] if urls else "redis://127.0.0.1:1/0"
    app = Celery("compat_options", broker=url, set_as_current=False)
    app.conf.update(conf)
    return app


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unique_on": 5}, r"unique_on=5 must be None \(every argument\), an argument name"),
        ({"unique_on": ["a"], "lock_key": ["a"]}, r"both unique_on=\['a'\] and lock_key"),
        ({"raise_on_duplicate": "yes"}, r"raise_on_duplicate='yes' must be True, False or None"),
        ({"lock_expiry": -1}, r"lock_expiry"),
        (
            {"unique_on": ["nope"]},
            r"unique_on=\['nope'\] names 'nope', which the task does not take",
        ),
        ({"once": {"keys": ["a"]}}, r"once=.* is an option of celery-once"),
    ],
    ids=["unique_on-type", "unique_on-and-lock_key", "raise-type", "expiry", "name", "once"],
)
def test_bad_singleton_options_are_refused_at_definition(
    options: dict[str, Any], message: str
) -> None:
    app = make_app()
    with pytest.raises(ConfigError, match=message):

        @app.task(base=Singleton, shared=False, **options)
        def t(a: int) -> None:
            pass

        t._get_current_object()  # Celery builds the task class lazily


@pytest.mark.parametrize(
    ("once", "message"),
    [
        ({"key": ["a"]}, r"has 'key', which is not one of 'graceful', 'timeout', 'keys'"),
        ({"keys": "a"}, r"once\['keys'\]='a' must be a list of argument names"),
        ({"keys": ["nope"]}, r"once\['keys'\]=\['nope'\] names 'nope'"),
        ({"timeout": 0}, r"once\['timeout'\]"),
        ("graceful", r"once='graceful' must be a dict"),
    ],
    ids=["misspelt", "keys-str", "keys-name", "timeout", "not-a-dict"],
)
def test_bad_once_options_are_refused_at_definition(once: Any, message: str) -> None:
    app = make_app()
    with pytest.raises(ConfigError, match=message):

        @app.task(base=QueueOnce, once=once, shared=False)
        def t(a: int) -> None:
            pass

        t._get_current_object()


def test_a_singleton_option_on_queue_once_is_refused() -> None:
    app = make_app()
    with pytest.raises(ConfigError, match=r"unique_on=\['a'\] is an option of celery-singleton"):

        @app.task(base=QueueOnce, unique_on=["a"], shared=False)
        def t(a: int) -> None:
            pass

        t._get_current_object()


def test_per_call_once_options_are_checked(single_urls: list[str]) -> None:
    app = make_app(single_urls)

    @app.task(base=QueueOnce, shared=False)
    def t(a: int) -> None:
        pass

    with pytest.raises(ConfigError, match=r"apply_async\(\): once=.* has 'keys'"):
        t.apply_async((1,), once={"keys": ["a"]}, queue=IDLE)
    with pytest.raises(ConfigError, match=r"once\['timeout'\]"):
        t.apply_async((1,), once={"timeout": "soon"}, queue=IDLE)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"ONCE": "redis://h:1/0"}, r"ONCE='redis://h:1/0' must be a dict"),
        ({"ONCE": {"settings": "x"}}, r"ONCE\['settings'\]='x' must be a dict"),
        ({"ONCE": {"settings": {"url": 5}}}, r"ONCE\['settings'\]\['url'\]=5 must be"),
        ({"ONCE": {"settings": {"default_timeout": -5}}}, r"default_timeout"),
        ({"ONCE": {"settings": {"blocking": True, "blocking_timeout": "x"}}}, r"blocking_timeout"),
    ],
    ids=["once-str", "settings-str", "url-int", "timeout", "blocking_timeout"],
)
def test_bad_once_settings_are_named(
    single_urls: list[str], setting: dict[str, Any], message: str
) -> None:
    app = make_app(single_urls, **setting)

    @app.task(base=QueueOnce, shared=False)
    def t(a: int) -> None:
        pass

    with pytest.raises(ConfigError, match=message):
        t.apply_async((1,), queue=IDLE)


def test_a_bad_singleton_lock_expiry_setting_is_named(single_urls: list[str]) -> None:
    app = make_app(single_urls, singleton_lock_expiry="soon")

    @app.task(base=Singleton, shared=False)
    def t(a: int) -> None:
        pass

    with pytest.raises(ConfigError, match="singleton_lock_expiry"):
        t.apply_async((1,), queue=IDLE)


def once_app(urls: list[str], **settings: Any) -> Any:
    app = make_app(urls, ONCE={"backend": "celery_once.backends.Redis", "settings": settings})

    @app.task(base=QueueOnce, shared=False)
    def t(a: int) -> None:
        pass

    return t


def test_blocking_publish_waits_for_the_key(single_urls: list[str]) -> None:
    t = once_app(single_urls, url=single_urls[0], blocking=True, blocking_timeout=10)
    t.once_backend.raise_or_lock(t.get_key((1,)), timeout=0.5)  # expires on its own
    started = time.monotonic()
    result = t.apply_async((1,), queue=IDLE)  # blocks until the key frees, then publishes
    assert result.id is not None
    assert 0.2 < time.monotonic() - started < 5


def test_blocking_publish_gives_up_after_blocking_timeout(single_urls: list[str]) -> None:
    t = once_app(single_urls, url=single_urls[0], blocking=True, blocking_timeout=0.3)
    t.once_backend.raise_or_lock(t.get_key((1,)), timeout=30)
    started = time.monotonic()
    with pytest.raises(AlreadyQueued) as info:
        t.apply_async((1,), queue=IDLE)
    assert 0.3 <= time.monotonic() - started < 3
    assert 25 < info.value.countdown <= 30


def test_an_overridden_on_duplicate_method_is_called(single_urls: list[str]) -> None:
    app = make_app(single_urls)
    seen: list[str] = []

    class Counting(Singleton):
        def on_duplicate(self, existing_task_id: str) -> Any:  # type: ignore[override]
            seen.append(existing_task_id)
            return "duplicate of " + existing_task_id

    @app.task(base=Counting, shared=False)
    def t(a: int) -> None:
        pass

    first = t.apply_async((1,), queue=IDLE)
    assert t.apply_async((1,), queue=IDLE) == f"duplicate of {first.id}"
    assert seen == [first.id]


def test_the_compat_classes_on_redlock(redlock_urls: list[str]) -> None:
    """With dlock_urls (five masters: Redlock) set, both classes lock there."""
    app = make_app(redlock_urls[:1], dlock_urls=redlock_urls)
    app.conf.singleton_backend_url = "redis://127.0.0.1:1/0"  # dlock_urls wins
    app.conf.ONCE = {"backend": "celery_once.backends.Redis", "settings": {"url": "redis://x/0"}}

    @app.task(base=Singleton, shared=False)
    def single(a: int) -> None:
        pass

    @app.task(base=QueueOnce, shared=False)
    def once(a: int) -> None:
        pass

    first = single.apply_async((1,), queue=IDLE)
    assert single.apply_async((1,), queue=IDLE) == first
    once.apply_async((1,), queue=IDLE)
    with pytest.raises(AlreadyQueued):
        once.apply_async((1,), queue=IDLE)
    assert single._dlock().manager.settings.urls == tuple(redlock_urls)
    assert once._dlock().manager is single._dlock().manager
    assert clear_locks(app) == [single.lock_key_for((1,), {})]  # queued Singleton keys only
    assert single.apply_async((1,), queue=IDLE) != first


def test_a_running_key_is_no_other_calls_queued_key(single_urls: list[str]) -> None:
    """QueueOnce with ``unlock_before_run`` runs a call under its key plus ``:running``; with
    a ``lock_key`` template the last value was filled in with ':' unescaped, so on 6005d89
    the call ``'x'`` running held the queued key of the call ``'x:running'``, which was refused
    as already queued (one request blocked another resource)."""
    from celery_dlock import lock

    app = make_app(single_urls)

    @app.task(base=QueueOnce, shared=False, once={"unlock_before_run": True}, lock_key="k:{a}")
    def t(a: str) -> None:
        pass

    running = t._execution_key(t.lock_key_for(("x",), {}), None)
    assert running != t.lock_key_for(("x:running",), {})
    with lock(single_urls, running, ttl=10):  # what the run of ('x',) holds
        queued = t.apply_async(("x:running",), queue=IDLE)
    assert queued.id
    from celery_dlock.ops import admin

    admin.release(single_urls, t.lock_key_for(("x:running",), {}))  # the message stays queued
