"""Lock keys for tasks: one call, one key, however its arguments were spelled.

A task's arguments are bound to its signature first (defaults applied), so ``collect("s", "e")``,
``collect(source="s", entity="e")`` and ``collect("s", "e", window=None)`` (when ``None`` is the
default) give one key. Values are put in a canonical form: dicts by sorted key, tuples as
lists, sets sorted; UUIDs, dates, datetimes, decimals and bytes by a tagged string; anything
else is refused with an error naming the argument, because a key built from ``repr()`` of an
arbitrary object could differ between two calls that mean the same thing.

``lock_key`` may be:

* ``None`` — the task name and every argument;
* a sequence of argument names — the task name and those arguments;
* a format template over argument names, ``"meta:{source}:{entity}"`` — that text, each value
  filled in with the characters that could run into the next part escaped (:class:`Template`),
  so that two different calls never share a key;
* a callable ``(args, kwargs) -> str`` — exactly what it returns.

Keys longer than :data:`LONG_KEY` characters are shortened to a readable prefix plus a SHA-256
digest of the whole.

A worker keys the arguments as the message's serializer gave them back, which is not always
what was sent: JSON turns ``{1: 10}`` into ``{"1": 10}`` and tuples into lists, YAML sorts dict
keys. Whoever keys a call *before* it is sent (enqueue-time mode, ``lock_key_for``) keys
:func:`wire_form` of it, the same round trip through kombu's serializer the message takes.
"""

from __future__ import annotations

import datetime
import decimal
import difflib
import hashlib
import inspect
import json
import math
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

from kombu.serialization import dumps, loads

from celery_dlock.core.errors import ConfigError

#: Keys longer than this are hashed (their readable start is kept).
LONG_KEY = 200

KeyFunction = Callable[[Sequence[Any], Mapping[str, Any]], str]


#: What the refusal of an unkeyable value tells the user to do instead (a task class may name
#: its own options: the compat classes name the peers').
UNKEYABLE_FIX = (
    "Key on other arguments with lock_key=[...], or give lock_key a template or a callable."
)


def _canonical(value: Any, where: str, fix: str = UNKEYABLE_FIX) -> Any:
    """A JSON-compatible value that is equal for equal inputs; raises for unkeyable ones."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return {"float": repr(value)}
        return value
    if isinstance(value, list | tuple):
        return [_canonical(v, f"{where}[{i}]", fix) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        items = [(_canonical(k, f"{where} key", fix), _canonical(v, f"{where}[{k!r}]", fix))
                 for k, v in value.items()]  # fmt: skip
        if all(isinstance(k, str) for k, _ in items):
            return dict(sorted(items, key=lambda kv: kv[0]))
        return {"dict": sorted(items, key=lambda kv: _dumps(kv[0]))}
    if isinstance(value, set | frozenset):
        return {"set": sorted((_canonical(v, f"{where} item", fix) for v in value), key=_dumps)}
    if isinstance(value, uuid.UUID):
        return {"uuid": str(value)}
    if isinstance(value, datetime.datetime):
        return {"datetime": value.isoformat()}
    if isinstance(value, datetime.date):
        return {"date": value.isoformat()}
    if isinstance(value, decimal.Decimal):
        return {"decimal": str(value)}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    raise ConfigError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which cannot be "
        "part of a lock key (only None, bool, int, float, str, list, tuple, dict, set, UUID, "
        f"date, datetime, Decimal and bytes can). {fix}"
    )


#: One encoder for every key: ``json.dumps`` with non-default options builds a new one per call.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
#: Its C core, made once (``JSONEncoder.encode`` makes one per call). No circular-reference
#: markers: what it encodes comes from :func:`_canonical`, which builds new, acyclic values.
_c_make_encoder: Any = getattr(json.encoder, "c_make_encoder", None)  # not in typeshed
_C_ENCODE: Any = (
    None
    if _c_make_encoder is None
    else _c_make_encoder(
        None, _ENCODER.default, json.encoder.encode_basestring, None, ":", ",", True, False, True
    )
)
#: Argument values written into a key as they are (exact types: a subclass goes through
#: :func:`_canonical`, as does a float, which may be infinite or NaN).
_PLAIN = frozenset({str, int, bool, type(None)})


def _dumps(value: Any) -> str:
    if _C_ENCODE is None:
        return _ENCODER.encode(value)
    return "".join(_C_ENCODE(value, 0))


#: What stands after a shortened key's first 64 characters.
_DIGEST_MARK = "…sha256:"


def shorten(key: str, lookalike: bool = False) -> str:
    """``key`` itself, or for a long one its first 64 characters and a digest of the whole.

    With ``lookalike``, a short key that reads like a shortened one (``…sha256:`` after its
    first 64 characters) is shortened too: its text may come from a request, and whoever
    knows a long call can compute that call's shortened key.
    """
    if len(key) <= LONG_KEY and not (lookalike and key[64:72] == _DIGEST_MARK):
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"{key[:64]}{_DIGEST_MARK}{digest}"


#: Values that JSON and pickle give back as they were sent (exact types: ``bool`` is one, an
#: ``int`` subclass is not): arguments made only of these skip the round trip.
_STABLE = frozenset({str, int, float, bool, type(None)})
_STABLE_SERIALIZERS = frozenset({"json", "pickle"})


def wire_form(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    serializer: str | None,
    task_name: str,
    names: Sequence[str] = (),
) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """``(args, kwargs)`` as a worker gets them from a message sent with ``serializer``.

    Raises :class:`ConfigError`, naming the argument (positional ones by ``names``, the task's
    parameter names, where given), when the serializer cannot carry a value there and back (a
    set under JSON, a datetime under msgpack, int dict keys under msgpack): such a message
    would fail to be sent or to be read, and no key could match across it.
    """
    serializer = serializer or "json"
    if (
        serializer in _STABLE_SERIALIZERS
        and all(type(v) in _STABLE for v in args)
        and all(type(v) in _STABLE for v in kwargs.values())
    ):
        return args, kwargs
    try:
        return _round_trip((list(args), dict(kwargs)), serializer)  # type: ignore[no-any-return]
    except Exception as exc:
        raise _unsendable(args, kwargs, serializer, task_name, names, exc) from None


def _round_trip(value: Any, serializer: str) -> Any:
    content_type, encoding, data = dumps(value, serializer=serializer)
    return loads(data, content_type, encoding, accept={content_type})


def _unsendable(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    serializer: str,
    task_name: str,
    names: Sequence[str],
    exc: Exception,
) -> ConfigError:
    """The error for arguments ``serializer`` cannot carry, naming the first that fails."""
    named = [
        (f"argument {names[i]!r}" if i < len(names) else f"positional argument {i}", v)
        for i, v in enumerate(args)
    ] + [(f"argument {k!r}", v) for k, v in kwargs.items()]
    which, reason = "the arguments", exc
    for name, value in named:
        try:
            _round_trip([value], serializer)
        except Exception as found:
            which, reason = f"{name} ({_short(value)})", found
            break
    return ConfigError(
        f"task {task_name!r}: {which} cannot be sent with the {serializer!r} serializer and "
        f"read back ({type(reason).__name__}: {reason}), so the worker could not key it as it "
        "was published. Send values this serializer carries (msgpack: no datetimes, Decimals, "
        "UUIDs, sets or non-str dict keys; JSON: no sets), or set the task's serializer."
    )


def encodable(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogate)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def first_surrogate(text: str) -> str:
    """The first lone surrogate in ``text`` and where, as ``'\\ud800' at 3``."""
    for i, char in enumerate(text):
        if "\ud800" <= char <= "\udfff":
            return f"{char!r} at {i}"
    return "none"


def _has_surrogate(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` (or a str inside it, a dict's keys too) holds a lone surrogate."""
    if isinstance(value, str):
        return not value.isascii() and not encodable(value)
    if depth > 20:
        return False
    if isinstance(value, Mapping):
        return any(_has_surrogate(k, depth + 1) or _has_surrogate(v, depth + 1)
                   for k, v in value.items())  # fmt: skip
    if isinstance(value, list | tuple | set | frozenset):
        return any(_has_surrogate(v, depth + 1) for v in value)
    return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


#: Escaped in every value a template fills in: the escape character, and the braces of a
#: Redis Cluster hash tag (a value must not end or open the key's tag).
ALWAYS_ESCAPED = "%{}"
#: String values that read as a constant's text: encoded whole, so that ``None`` and
#: ``"None"`` fill in different keys.
_CONSTANT_TEXTS = frozenset({"None", "True", "False"})


#: Values a template fills in as their canonical JSON (their ``str()`` is not canonical: a
#: set's order changes with each process's hash seed, a dict's with insertion order).
_CONTAINERS = (list, tuple, dict, set, frozenset, bytes)
#: Opens a container's text in a filled key: no string can fill in ``%j`` (a string's ``%``
#: is always escaped, ``%25``), so a list and the string of its text differ.
CONTAINER_MARK = "%json"


def _address_only(value: Any) -> bool:
    """Whether ``value``'s only text is ``object``'s, which holds its address: a different
    key in every process."""
    kind: Any = type(value)
    return all(getattr(kind, name) is getattr(object, name)
               for name in ("__format__", "__str__", "__repr__"))  # fmt: skip


def _escapes(chars: str) -> dict[int, str]:
    return {ord(c): quote(c, safe="") for c in chars}


class Template:
    """A ``lock_key`` template whose filling is injective in the values filled in.

    Each value's text has ``%`` (the escape), ``{``, ``}`` and the first character of the
    literal text that follows its field percent-encoded (``"acme:eu"`` in
    ``"meta:{source}:{entity}"`` is ``acme%3Aeu``), so a value cannot run into the next part:
    ``("acme:eu", "invoice-7")`` and ``("acme", "eu:invoice-7")`` fill different keys. A value
    without those characters is written as it always was. A str that reads ``None``, ``True``
    or ``False`` is encoded whole (``%4E%6F%6E%65``), so it differs from the constant.
    Numbers and their decimal strings (``5``, ``"5"``) still fill the same text. A list,
    tuple, dict, set or bytes value fills in ``%json`` and its canonical JSON, escaped alike
    (the same in every process, whatever the order; no string fills in ``%j``); an object
    whose only text holds its address is refused, naming the argument. A format spec
    (``{day:%Y-%m-%d}``, ``{n:>5}``) is applied as written: what it cuts or pads may merge
    values.
    """

    def __init__(
        self,
        parsed: Sequence[tuple[str, str | None, str | None, str | None]],
        task_name: str = "",
        fix: str = UNKEYABLE_FIX,
    ) -> None:
        self._task_name = task_name
        self._fix = fix
        formatter = string.Formatter()
        self._formatter = formatter
        self._parts: list[tuple[str, str | None, str, str | None, dict[int, str]]] = []
        for i, (literal, field, spec, conversion) in enumerate(parsed):
            following = parsed[i + 1][0] if i + 1 < len(parsed) else ""
            table = _escapes(ALWAYS_ESCAPED + following[:1])
            self._parts.append((literal, field, spec or "", conversion, table))

    def fill(self, values: Mapping[str, Any]) -> str:
        out: list[str] = []
        for literal, field, spec, conversion, table in self._parts:
            out.append(literal)
            if field is not None:
                out.append(self._filled(values, field, spec, conversion, table))
        return "".join(out)

    def _filled(
        self,
        values: Mapping[str, Any],
        field: str,
        spec: str,
        conversion: str | None,
        table: dict[int, str],
    ) -> str:
        """One field's text; a value its index, attribute or spec does not fit (an empty list,
        a str for ``{n:d}``) is a :class:`ConfigError` naming the argument."""
        name = field.split(".", 1)[0].split("[", 1)[0]
        try:
            if field in values:
                value = values[field]
            else:
                value = self._formatter.get_field(field, (), values)[0]
            given_str = type(value) is str  # before a conversion: None!s is a str
            if not spec and (isinstance(value, _CONTAINERS) or _address_only(value)):
                where = f"argument {field!r} of task {self._task_name!r}"
                json_text = _dumps(_canonical(value, where, self._fix))
                return CONTAINER_MARK + json_text.translate(table)
            if conversion is not None:
                value = self._formatter.convert_field(value, conversion)
            text = value if type(value) is str and not spec else format(value, spec)
        except ConfigError:
            raise
        except (LookupError, AttributeError, TypeError, ValueError) as exc:
            shown = field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ConfigError(
                f"task {self._task_name!r}: argument {name!r} ({_short(values.get(name))}) "
                f"cannot fill lock_key field '{{{shown}}}' ({type(exc).__name__}: {exc}). "
                "Check the value before sending it, or key with a lock_key callable."
            ) from None
        if given_str and text in _CONSTANT_TEXTS:
            return "".join(f"%{ord(c):02X}" for c in text)
        return text.translate(table)


class KeyBuilder:
    """Turns a task call's ``(args, kwargs)`` into its lock key; built once per task class."""

    def __init__(
        self, task_name: str, run: Callable[..., Any], lock_key: Any, fix: str = UNKEYABLE_FIX
    ) -> None:
        self.task_name = task_name
        self.lock_key = lock_key
        self.fix = fix  # the refusal of an unkeyable argument ends with it
        try:
            self.signature: inspect.Signature | None = inspect.signature(run)
        except (TypeError, ValueError):  # a builtin or otherwise opaque callable
            self.signature = None
        self._simple_signature = self._simple()
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self._positional = [p.name for p in self._parameters().values() if p.kind in positional]
        self._build = self._make(lock_key)

    def __call__(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        key = self._build(args, kwargs)
        if not key.isascii() and not encodable(key):
            raise self._unencodable(args, kwargs, key)
        return key

    def _unencodable(self, args: Sequence[Any], kwargs: Mapping[str, Any], key: str) -> ConfigError:
        """The error for a key holding a lone surrogate, naming the argument it came from."""
        try:
            named = list(self._lookup(args, kwargs).items())
        except TypeError:
            named = [(f"positional argument {i}", v) for i, v in enumerate(args)]
            named += list(kwargs.items())
        which = next(
            (f"argument {name!r}" if not name.startswith("positional") else name
             for name, value in named if _has_surrogate(value)),
            "the lock_key callable's result",
        )  # fmt: skip
        return ConfigError(
            f"task {self.task_name!r}: {which} holds a lone surrogate "
            f"({first_surrogate(key)} of its key), which no lock store can encode; kombu's "
            "JSON turns a '\\ud800' escape into one. Clean the value before sending it (e.g. "
            "text.encode('utf-8', 'replace').decode()), or key on other arguments."
        )

    def sent(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], serializer: str | None
    ) -> tuple[Sequence[Any], Mapping[str, Any]]:
        """:func:`wire_form` of a call of this task: what its worker will key."""
        return wire_form(args, kwargs, serializer, self.task_name, self._positional)

    def _make(self, lock_key: Any) -> KeyFunction:
        where = f"task {self.task_name!r}: lock_key"
        if lock_key is None:
            return lambda args, kwargs: self._named(self._bind(args, kwargs))
        if isinstance(lock_key, str):
            fields = self._template_fields(lock_key, where)
            return lambda args, kwargs: self._format(lock_key, fields, args, kwargs)
        if callable(lock_key):
            return lambda args, kwargs: self._call(lock_key, args, kwargs)
        if isinstance(lock_key, Sequence) and all(isinstance(n, str) for n in lock_key):
            names = list(lock_key)
            self._check_names(names, where)
            return lambda args, kwargs: self._named(
                {n: v for n, v in self._lookup(args, kwargs).items() if n in names}
            )
        raise ConfigError(
            f"{where} must be None, a list of argument names, a template such as "
            f"'meta:{{source}}:{{entity}}', or a callable (args, kwargs) -> str; got {lock_key!r}."
        )

    def _parameters(self) -> Mapping[str, inspect.Parameter]:
        return {} if self.signature is None else self.signature.parameters

    def _check_names(self, names: Sequence[str], where: str) -> None:
        if self.signature is None:
            return
        params = self._parameters()
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        unknown = [n for n in names if n not in params and not takes_any]
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(params), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{where} names {', '.join(map(repr, unknown))}, which the task does not take; "
                f"its arguments are {', '.join(params) or '(none)'}.{hint}"
            )

    def _template_fields(self, template: str, where: str) -> list[str]:
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise ConfigError(f"{where} {template!r} is not a valid template: {exc}.") from None
        fields = []
        for i, (_, field, _, _) in enumerate(parsed):
            if field is None:
                continue
            name = field.split(".", 1)[0].split("[", 1)[0]
            if not name or name.isdigit():
                raise ConfigError(
                    f"{where} {template!r} must name arguments, e.g. '{{source}}', not "
                    f"'{{{field}}}'."
                )
            following = parsed[i + 1] if i + 1 < len(parsed) else None
            if following is not None and not following[0] and following[1] is not None:
                raise ConfigError(
                    f"{where} {template!r} puts '{{{field}}}' and '{{{following[1]}}}' side by "
                    "side: two different calls could fill in one key (('ab', 'c') and "
                    f"('a', 'bc')); put a separator between them, e.g. '{{{field}}}:"
                    f"{{{following[1]}}}'."
                )
            fields.append(name)
        self._check_names(fields, where)
        if not fields and template in self._parameters():
            # A template without fields is one constant key: almost surely not what someone
            # who wrote an argument's name meant (celery-singleton's unique_on spelling).
            raise ConfigError(
                f"{where} {template!r} is a constant key, but names an argument: every call "
                f"would share one lock. Write lock_key=['{template}'] or '{{{template}}}' to "
                "key on that argument."
            )
        self._template = Template(parsed, self.task_name, self.fix)
        return fields

    def _simple(self) -> tuple[list[str], dict[str, Any]] | None:
        """Names and defaults of a signature of plain positional-or-keyword parameters."""
        if self.signature is None:
            return None
        params = list(self.signature.parameters.values())
        if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
            return None
        defaults = {p.name: p.default for p in params if p.default is not p.empty}
        return [p.name for p in params], defaults

    def _fast_bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
        """Bind a plain signature without inspect's general (and slower) machinery; None
        when the call is not simple, or wrong (the general binding then says why)."""
        if self._simple_signature is None:
            return None
        names, defaults = self._simple_signature
        if len(args) > len(names):
            return None
        bound = dict(zip(names, args, strict=False))
        for name, value in kwargs.items():
            if name in bound or name not in self._parameters():
                return None
            bound[name] = value
        for name in names:
            if name not in bound:
                if name not in defaults:
                    return None
                bound[name] = defaults[name]
        return {name: bound[name] for name in names}

    def _bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Arguments by parameter name, defaults applied; ``*args``/``**kw`` kept as such."""
        if self.signature is None:
            return {"args": list(args), "kwargs": dict(kwargs)}
        fast = self._fast_bind(args, kwargs)
        if fast is not None:
            return fast
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"task {self.task_name!r} called with bad arguments: {exc}") from None
        bound.apply_defaults()
        return dict(bound.arguments)

    def _lookup(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Bound arguments with ``**kwargs`` entries lifted to the top, for lookup by name."""
        arguments = self._bind(args, kwargs)
        for param in self._parameters().values():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                extra = arguments.pop(param.name, {})
                arguments.update({k: v for k, v in extra.items() if k not in arguments})
        return arguments

    def _named(self, arguments: Mapping[str, Any]) -> str:
        canonical = {
            name: value
            if type(value) in _PLAIN
            else _canonical(value, f"argument {name!r} of task {self.task_name!r}", self.fix)
            for name, value in arguments.items()
        }
        return shorten(f"{self.task_name}:{_dumps(canonical)}")

    def _format(
        self, template: str, fields: list[str], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> str:
        arguments = self._lookup(args, kwargs)
        filled = self._template.fill({name: arguments.get(name) for name in fields})
        return shorten(filled, lookalike=True)

    def _call(self, fn: KeyFunction, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        key = fn(args, kwargs)
        if not isinstance(key, str) or not key:
            raise ConfigError(
                f"task {self.task_name!r}: lock_key callable {fn!r} returned {key!r}; it must "
                "return a non-empty str."
            )
        return shorten(key)
