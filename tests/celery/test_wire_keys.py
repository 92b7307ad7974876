"""A call keys the same at publish and in the worker, whatever the serializer did to it.

Property-based (hypothesis): arguments are drawn from what each of Celery's serializers carries
(json, pickle, msgpack, yaml), nested; the publisher's key (what ``SingletonTask.apply_async``
keys in enqueue-time mode) must equal the worker's key of the arguments it gets back from the
real message body, built by Celery and sent through kombu's serializer registry — for
``lock_key=None``, a list of argument names, and a template. No broker or worker is needed:
the round trip is the serializer's, and nothing else touches the arguments on the way.

Settings: :data:`EXAMPLES` examples per serializer and key form per run (12 combinations), no
example database (CI starts from a fresh clone), no deadline (a loaded machine is slow). A
failure prints the falsifying arguments (hypothesis does), and the two keys.
"""

from __future__ import annotations

import datetime
import decimal
import functools
import json
import uuid
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from kombu.serialization import dumps, loads

from celery_dlock import ConfigError, SingletonTask

# Hypothesis notes a change of the global ``random`` state during a draw as a strategy using
# ``random``; with warnings as errors that fails the example, and the replay that does not
# meet it reports flaky generation. The strategies here draw nothing from ``random``, but a
# thread of this process may (a kazoo client's connection loop, redis-py's retry backoff, left
# by a module that ran earlier in the same process), so the note is not about this module.
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")

EXAMPLES = 150
SERIALIZERS = ("json", "pickle", "msgpack", "yaml")
LOCK_KEYS = {
    "every-argument": None,
    "names": ["payload", "label"],
    "template": "wire:{payload}:{label}",
}

app = Celery("wire", set_as_current=False)
app.conf.dlock_urls = ["redis://127.0.0.1:1/0"]  # never contacted: keys only


@functools.cache
def _task(kind: str, serializer: str) -> Any:
    def job(payload: Any, label: Any = "x", extra: Any = None) -> None: ...

    task = app.task(
        base=SingletonTask,
        shared=False,
        name=f"wire.{kind}.{serializer}",
        lock_key=LOCK_KEYS[kind],
        lock_on="enqueue",
        serializer=serializer,
    )(job)
    return task._get_current_object()


# -- what each serializer carries -----------------------------------------------------------

_ints64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
_floats = st.floats(allow_nan=True, allow_infinity=True)
_datetimes = st.datetimes() | st.datetimes(timezones=st.just(datetime.timezone.utc))


def _leaves(serializer: str) -> st.SearchStrategy[Any]:
    common = st.none() | st.booleans() | _floats | st.text(max_size=8) | st.binary(max_size=8)
    if serializer == "msgpack":
        return common | _ints64
    if serializer == "yaml":
        return common | st.integers() | _datetimes | st.dates()
    extra = (
        st.integers()
        | _datetimes
        | st.dates()
        | st.decimals(allow_nan=False, places=3)
        | st.uuids()
    )
    if serializer == "pickle":
        extra = extra | st.frozensets(st.integers(), max_size=3)
    return common | extra


def _keys(serializer: str) -> st.SearchStrategy[Any]:
    """Dict keys: JSON turns int, float, bool and None keys into strings; msgpack (as kombu
    reads it) takes only str and bytes keys."""
    if serializer == "msgpack":
        return st.text(max_size=5) | st.binary(max_size=5)
    keys = st.text(max_size=5) | st.integers() | st.booleans() | st.none()
    finite = st.floats(allow_nan=False, allow_infinity=False)
    if serializer == "pickle":
        return keys | finite | st.tuples(st.integers(), st.text(max_size=3))
    return keys | finite


def arguments(serializer: str) -> st.SearchStrategy[Any]:
    return st.recursive(
        _leaves(serializer),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.tuples(inner, inner)
            | st.dictionaries(_keys(serializer), inner, max_size=3)
        ),
        max_leaves=10,
    )


def worker_side(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], serializer: str) -> Any:
    """The arguments as a worker gets them: Celery's message body through kombu's serializer."""
    message = app.amqp.as_task_v2("the-id", task.name, args=args, kwargs=kwargs)
    content_type, encoding, data = dumps(message.body, serializer=serializer)
    sent_args, sent_kwargs, _ = loads(data, content_type, encoding, accept={content_type})
    return sent_args, sent_kwargs


@pytest.mark.parametrize("kind", list(LOCK_KEYS))
@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_the_key_at_publish_is_the_key_in_the_worker(serializer: str, kind: str) -> None:
    task = _task(kind, serializer)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(payload=arguments(serializer), label=arguments(serializer), by_name=st.booleans())
    def check(payload: Any, label: Any, by_name: bool) -> None:
        args, kwargs = ((payload,), {"label": label}) if by_name else ((payload, label), {})
        published = task._wire_key(args, kwargs, serializer)  # what apply_async keys
        in_worker = task._dlock().keys(*worker_side(task, args, kwargs, serializer))
        note(f"published: {published!r}\nin worker: {in_worker!r}")
        assert published == in_worker
        assert task.lock_key_for(args, kwargs) == published

    check()


@pytest.mark.parametrize(
    ("serializer", "value", "why"),
    [
        ("json", {1, 2}, "set"),
        ("msgpack", datetime.datetime(2024, 5, 6, 7, 8, 9), "datetime"),
        ("msgpack", decimal.Decimal("1.5"), "Decimal"),
        ("msgpack", {1: 10}, "int"),
        ("msgpack", 2**70, "out of range"),
        ("yaml", uuid.UUID(int=7), "cannot represent"),
    ],
    ids=[
        "json-set",
        "msgpack-datetime",
        "msgpack-decimal",
        "msgpack-int-keys",
        "msgpack-bigint",
        "yaml-uuid",
    ],
)
def test_a_value_the_serializer_cannot_carry_fails_at_publish_naming_it(
    serializer: str, value: Any, why: str
) -> None:
    # msgpack writes {1: 10} but kombu will not read int keys back: the worker would fail on
    # it after the publisher had taken a queued lock under a key nobody else computes.
    task = _task("every-argument", serializer)
    with pytest.raises(ConfigError) as info:
        task.apply_async(("ok",), {"label": value})
    message = str(info.value)
    assert f"task {task.name!r}: argument 'label' ({value!r}) cannot be sent with the " in message
    assert f"{serializer!r} serializer" in message
    assert why in message


def test_json_gives_int_keys_back_as_strings_and_both_ends_key_that() -> None:
    task = _task("every-argument", "json")
    key = task.lock_key_for(({1: 10, 2.5: [(1, 2)]},), {})
    assert key == task.lock_key_for(({"1": 10, "2.5": [[1, 2]]},), {})
    assert (
        key
        == 'wire.every-argument.json:{"extra":null,"label":"x","payload":{"1":10,"2.5":[[1,2]]}}'
    )


_JSON_LEAF = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(_JSON_LEAF, lambda c: st.lists(c) | st.dictionaries(st.text(), c), max_leaves=20)
)
def test_the_key_encoder_writes_what_json_dumps_writes(value: Any) -> None:
    # keys._dumps calls json's C encoder directly (made once); a key must stay the same
    # string the documented encoding gives, or keys change across versions.
    from celery_dlock.celery import keys

    expected = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert keys._dumps(value) == expected
