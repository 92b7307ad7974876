"""The key builder (``celery_dlock.celery.keys``) on its own: canonical values, arguments it cannot
key, long keys, and the three ways to name a key (a list, a template, a callable)."""

from __future__ import annotations

import datetime
import decimal
import uuid

import pytest

from celery_dlock import ConfigError
from celery_dlock.celery.keys import LONG_KEY, KeyBuilder


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
