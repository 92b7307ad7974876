"""SingletonTask without a worker: options checked at definition, keys, eager runs."""

from __future__ import annotations

import datetime
import decimal
import uuid
from typing import Any

import pytest
from celery import Celery

from celery_dlock import ConfigError, SingletonTask, lock
from celery_dlock.celery.keys import LONG_KEY, KeyBuilder


def make_app(urls: list[str] | None = None) -> Celery:
    app = Celery("opts", set_as_current=False)
    app.conf.dlock_urls = urls or ["redis://127.0.0.1:1/0"]
    app.conf.task_always_eager = False
    return app


def define(app: Celery, **options: Any) -> Any:
    def body(source: str, entity: str, window: Any = None) -> str:
        return f"{source}:{entity}"

    # Not shared: a shared task would be copied into every app finalized later in this run.
    task = app.task(base=SingletonTask, name="opts.body", shared=False, **options)(body)
    return task._get_current_object() if hasattr(task, "_get_current_object") else task


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"on_duplicate": "skip"}, "on_duplicate='skip' is not one of 'drop', 'requeue'"),
        ({"lock_on": "publish"}, "lock_on='publish' is not one of 'execute', 'enqueue'"),
        ({"on_lock_lost": "ignore"}, "on_lock_lost='ignore' is not one of 'raise', 'flag'"),
        ({"on_lock_unavailable": "run"}, "on_lock_unavailable='run' is not one of"),
        ({"lock_ttl": 0}, "lock_ttl must be > 0 seconds, got 0"),
        ({"lock_ttl": "30"}, "lock_ttl must be a number of seconds, not '30'"),
        ({"lock_wait": -1}, "lock_wait must be > 0 seconds"),
        ({"lock_requeue_max": -1}, "lock_requeue_max must be an int >= 0, got -1"),
        ({"lock_requeue_max": 2.5}, "lock_requeue_max must be an int >= 0"),
        (
            {"lock_requeue_delay": 5, "lock_requeue_max_delay": 1},
            "lock_requeue_max_delay (1 s) is below lock_requeue_delay (5 s)",
        ),
        ({"lock_queued_ttl": 0}, "lock_queued_ttl must be > 0 seconds"),
        ({"lock_max_hold": -3}, "lock_max_hold must be > 0 seconds"),
        (
            {"lock_on": "enqueue", "on_duplicate": "wait"},
            "on_duplicate='wait' does not apply with lock_on='enqueue'",
        ),
        ({"lock_key": "{nope}"}, "lock_key names 'nope', which the task does not take"),
        (
            {"lock_key": "meta:{sorce}:{entity}"},
            "its arguments are source, entity, window. Did you mean 'source'?",
        ),
        ({"on_duplicate": "reque"}, "'raise', 'wait'. Did you mean 'requeue'?"),
        ({"lock_key": ["source", "missing"]}, "names 'missing', which the task does not take"),
        ({"lock_key": "{0}"}, "must name arguments, e.g. '{source}', not '{0}'"),
        ({"lock_key": "{source"}, "is not a valid template"),
        ({"lock_key": 42}, "lock_key must be None, a list of argument names, a template"),
        (
            {"lock_key": "entity"},
            "lock_key 'entity' is a constant key, but names an argument: every call would "
            "share one lock. Write lock_key=['entity'] or '{entity}'",
        ),
    ],
)
def test_bad_options_fail_when_the_task_is_defined(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        define(make_app(), **options)
    assert message in str(info.value)
    assert "task 'opts.body'" in str(info.value)


def test_positional_keyword_and_default_spellings_give_one_key() -> None:
    task = define(make_app())
    keys = {
        task.lock_key_for(("s", "e"), {}),
        task.lock_key_for((), {"entity": "e", "source": "s"}),
        task.lock_key_for(("s", "e", None), {}),
    }
    assert keys == {'opts.body:{"entity":"e","source":"s","window":null}'}
    assert task.lock_key_for(("s", "e", 1), {}) not in keys


def test_canonical_values() -> None:
    build = KeyBuilder("t", lambda payload: None, None)
    same = [
        ({"b": 1, "a": [1, 2]}, {"a": (1, 2), "b": 1}),
        ({1, 2, 3}, {3, 2, 1}),
        ({2: "x", 1: "y"}, {1: "y", 2: "x"}),
    ]
    for left, right in same:
        assert build((left,), {}) == build((right,), {})
    distinct = [1, 1.0, True, "1", None, b"1", uuid.UUID(int=1), decimal.Decimal("1")]
    assert len({build((v,), {}) for v in distinct}) == len(distinct)
    assert "datetime" in build((datetime.datetime(2026, 1, 1),), {})


def test_an_unkeyable_argument_is_named() -> None:
    build = KeyBuilder("t", lambda source, payload: None, None)
    with pytest.raises(ConfigError, match=r"argument 'payload' of task 't' is a builtins.object"):
        build(("s", object()), {})
    with pytest.raises(ConfigError, match=r"argument 'payload' of task 't'\['k'\]"):
        build(("s", {"k": object()}), {})


def test_long_keys_are_hashed_keeping_a_readable_start() -> None:
    build = KeyBuilder("t", lambda payload: None, None)
    key = build(("x" * 1000,), {})
    assert len(key) < LONG_KEY
    assert key.startswith('t:{"payload":"xxx')
    assert "sha256:" in key
    assert build(("x" * 999 + "y",), {}) != key


def test_key_list_template_and_callable() -> None:
    by_names = KeyBuilder("t", lambda source, entity, window=None: None, ["source"])
    assert by_names(("s", "e"), {}) == by_names(("s", "other"), {}) == 't:{"source":"s"}'
    template = KeyBuilder("t", lambda source, entity, **extra: None, "{source}/{region}")
    assert template(("s", "e"), {"region": "eu"}) == "s/eu"
    called = KeyBuilder("t", lambda *a: None, lambda args, kwargs: f"k:{args[0]}")
    assert called(("z",), {}) == "k:z"
    bad = KeyBuilder("t", lambda *a: None, lambda args, kwargs: 3)
    with pytest.raises(ConfigError, match="returned 3; it must return a non-empty str"):
        bad((), {})


def test_eager_duplicate_is_dropped_naming_the_holder(single_urls: list[str]) -> None:
    app = make_app(single_urls)
    task = define(app, lock_key="meta:{source}:{entity}")
    with lock(app, "meta:s:e", ttl=10, holder="task-holding"):
        dropped = task.apply(("s", "e")).get()
        assert dropped["dlock_dropped"] is True
        assert dropped["holder"] == "task-holding"
        assert task("s", "e") == "s:e"  # a plain call takes no lock
    assert task.apply(("s", "e")).get() == "s:e"


def test_eager_raise_policy(single_urls: list[str]) -> None:
    app = make_app(single_urls)
    task = define(app, lock_key="meta:{source}:{entity}", on_duplicate="raise")
    with lock(app, "meta:s:e", ttl=10, holder="task-holding"):
        result = task.apply(("s", "e"))
        assert result.state == "FAILURE"
        assert type(result.result).__name__ == "LockContended"
        assert "task-holding" in str(result.result)


def test_settings_default_the_ttl(single_urls: list[str]) -> None:
    app = make_app(single_urls)
    app.conf.dlock_ttl = 12

    seen: list[float] = []

    @app.task(base=SingletonTask, bind=True)
    def read_ttl(self: Any) -> None:
        seen.append(self.lease.ttl)

    read_ttl.apply()
    assert seen == [12]
