"""Settings: read once from ``app.conf`` (or given as URLs), validated, with clear errors.

Every ``dlock_*`` setting is optional except where no Redis URL can be found at all:

================================  ===========  ==============================================
setting                           default      meaning
================================  ===========  ==============================================
``dlock_urls``                    broker URL   one URL = single Redis; three or more = Redlock;
                                               one ``zookeeper://h1,h2,h3/chroot`` = ZooKeeper
``dlock_ttl``                     30           lease length in seconds, renewed while held
``dlock_prefix``                  ``"dlock"``  prefix of every Redis key the library writes
``dlock_node_timeout``            0.5          seconds one Redis node may take to answer
``dlock_drift_factor``            0.01         clock drift allowance, as a fraction of the ttl
``dlock_fence_retention``         86400        seconds a key's fence counter is kept unused
================================  ===========  ==============================================
"""

from __future__ import annotations

import difflib
import importlib
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_plus, urlencode

from celery_dlock.core.errors import ConfigError

DEFAULT_TTL = 30.0
DEFAULT_PREFIX = "dlock"
DEFAULT_NODE_TIMEOUT = 0.5
DEFAULT_DRIFT_FACTOR = 0.01
#: One day: a released key leaves nothing in Redis a day later. Tokens do not rest on the
#: counter's history alone: a missing counter restarts at the server clock in microseconds.
DEFAULT_FENCE_RETENTION = 24 * 3600.0
#: Longest user key accepted as is; longer keys should be hashed (task keys are, automatically).
MAX_KEY_LENGTH = 1024
#: Least validity a lease may start with after the drift allowance.
MIN_VALIDITY = 0.01
#: Query options whose values are secrets (shown as ``***``); "pas": misspelt passwords too.
_SECRET_MARKERS = ("pas", "pwd", "secret", "token")


class DLockConfigWarning(UserWarning):
    """A setting works but is probably not what was meant (e.g. an even number of nodes)."""


def redact(url: Any) -> str:
    """The URL with every password (user info, ``*password*`` query options) as ``***``.

    Read from the raw text, not through ``urlsplit``, so that a password holding a raw ``/``,
    ``?``, ``#``, ``@`` or ``:`` (which URL parsers split elsewhere) is hidden too: everything
    after the user name's ``:`` up to the *last* ``@`` goes, and a secret query option's value
    runs to the next ``&name=`` (a ``#`` does not end it). Errs towards hiding: an ``@`` in a
    query value hides what stands before it.
    """
    if not isinstance(url, str):
        return "<not a URL>"
    hidden = [False] * len(url)
    start = url.find("://")
    start = 0 if start < 0 else start + 3
    at = url.rfind("@", start)
    if at >= 0:
        colon = url.find(":", start, at)
        if colon >= 0:
            for i in range(colon + 1, at):
                hidden[i] = True
    for match in _OPTION.finditer(url, start):
        if secret_option(unquote_plus(match.group(1))):  # parsers decode names too
            end = _NEXT_OPTION.search(url, match.end())
            for i in range(match.end(), end.start() if end else len(url)):
                hidden[i] = True
    if not any(hidden):
        return url
    out: list[str] = []
    for i, char in enumerate(url):
        if not hidden[i]:
            out.append(char)
        elif i == 0 or not hidden[i - 1]:
            out.append("***")
    return "".join(out)


#: A query option's name (percent-encoded or not), as it opens the option; and the start of
#: the next one.
_OPTION = re.compile(r"[?&]([^&=#?]+)=")
_NEXT_OPTION = re.compile(r"&[A-Za-z_][A-Za-z0-9_.-]*=")


#: What a URL with a password that URL parsers cannot read is told (see :func:`misread_userinfo`).
PERCENT_ENCODE = (
    "percent-encode '/', '?', '#' and '@' in the user name and password ('/' as %2F, '?' as "
    "%3F, '#' as %23, '@' as %40; urllib.parse.quote(password, safe='') does it)"
)


def misread_userinfo(url: str) -> bool:
    """Whether URL parsers would end ``url``'s user info early: an ``@`` stands in what they
    read as the path or fragment (or a query piece that is no ``name=value``), which means a
    raw ``/``, ``#`` or ``?`` in the password. Such a URL cannot authenticate, and the pieces
    a parser makes of it (host, path, database) hold parts of the password."""
    rest = url.partition("://")[2] if "://" in url else url
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    if "@" not in tail:
        return False
    if url.lower().startswith("unix:"):
        # unix://[user:password@]/path: the path may hold an '@'; user info ends with one.
        return bool(netloc) and not netloc.endswith("@")
    before_fragment, _, fragment = tail.partition("#")
    path, _, query = before_fragment.partition("?")
    piece = query.partition("@")[0].rpartition("&")[2]  # the option an '@' stands in
    return "@" in path or "@" in fragment or ("@" in query and "=" not in piece)


def secret_option(option: str) -> bool:
    """Whether a URL query option holds a secret (a password, token, ...)."""
    return any(marker in option.lower() for marker in _SECRET_MARKERS)


#: The values ``ssl_cert_reqs`` takes (redis-py's and kazoo's reading of them).
CERT_REQS = ("required", "optional", "none")
_FALSE = ("0", "f", "false", "n", "no", "off")


def tls_warnings(urls: Sequence[str]) -> list[str]:
    """One line per TLS URL whose options turn verification off (``ssl_cert_reqs=none``,
    ``ssl_check_hostname=false``): such a connection is encrypted but not authenticated, so
    whoever sits on the path can pose as the server, read the password and every lock."""
    found: list[str] = []
    for url in urls:
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if not (scheme.startswith("rediss") or scheme == "zookeepers"):
            continue
        query = url.partition("?")[2].partition("#")[0]
        options = {  # decoded as redis-py decodes them: ssl%5Fcert%5Freqs=%6Eone is off too
            unquote_plus(name).lower(): unquote_plus(value)
            for name, _, value in (p.partition("=") for p in query.split("&"))
        }
        off = []
        if options.get("ssl_cert_reqs", "").lower() == "none":
            off.append("ssl_cert_reqs=none: the server's certificate and host name are not checked")
        elif options.get("ssl_check_hostname", "").lower() in _FALSE:
            off.append("ssl_check_hostname=false: the server's host name is not checked")
        if off:
            found.append(
                f"{redact(url)}: TLS verification is off ({'; '.join(off)}), so anyone on the "
                "network path can pose as the server and read the password and the locks; "
                "give ssl_ca_certs=/path/to/ca.pem and drop the option"
            )
    return found


def quorum(n: int) -> int:
    """Nodes that must agree: a strict majority."""
    return n // 2 + 1


#: URL scheme (the part before any ``+``) → the module of the lock store that serves it. Imported
#: by name when first needed, as Celery picks a result backend and kombu a transport, so that
#: the settings, the lease core and the Celery layer import no backend. A backend module offers
#: ``check_urls(urls, setting)`` (the URLs, checked) and ``make_backend(settings)`` (a
#: :class:`celery_dlock.core.backend.Backend`). A scheme not listed goes to the Redis backend, whose
#: check names every scheme there is.
BACKENDS: dict[str, str] = {
    "redis": "celery_dlock.backends.redis",
    "rediss": "celery_dlock.backends.redis",
    "unix": "celery_dlock.backends.redis",
    "zookeeper": "celery_dlock.backends.zookeeper",
    "zookeepers": "celery_dlock.backends.zookeeper",  # TLS
    "memory": "celery_dlock.backends.memory",  # in-process, for tests
}
DEFAULT_BACKEND = "celery_dlock.backends.redis"
#: The pip extra that brings a backend's client library (``pip install celery-dlock[...]``).
EXTRAS: dict[str, str] = {"celery_dlock.backends.zookeeper": "zookeeper"}


def backend_module(urls: Sequence[Any], setting: str = "dlock_urls") -> Any:
    """The backend module that serves ``urls`` (all of them: one list, one kind of store)."""
    for url in urls:
        _check_scheme(url, setting)
    names = {BACKENDS.get(_scheme(url), DEFAULT_BACKEND) for url in urls}
    if len(names) > 1:
        shown = ", ".join(repr(redact(url)) for url in urls if isinstance(url, str))
        raise ConfigError(
            f"{setting} mixes kinds of lock store ({shown}): every URL of one list must name "
            "the same kind; keep the URLs of one of them."
        )
    name = names.pop() if names else DEFAULT_BACKEND
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]  # the distribution's top-level package
        if not missing or missing == name or name.startswith(f"{missing}."):
            raise  # this library itself is broken, not a dependency missing
        shown = ", ".join(repr(redact(url)) for url in urls if isinstance(url, str))
        extra = EXTRAS.get(name)
        fix = f"pip install 'celery-dlock[{extra}]'" if extra else f"pip install {missing}"
        raise ConfigError(
            f"{setting} ({shown}) needs the Python package {missing!r}, which is not "
            f"installed; install it: {fix}."
        ) from exc


def _check_scheme(url: Any, setting: str) -> None:
    """Refuse a misspelt scheme of a backend other than Redis (whose own check names every
    Redis scheme), e.g. ``zookeper://``, naming the one meant."""
    scheme = _scheme(url)
    if not scheme or scheme in BACKENDS:
        return
    others = [s for s, module in BACKENDS.items() if module != DEFAULT_BACKEND]
    close = difflib.get_close_matches(scheme, others, n=1, cutoff=0.75)
    if close:
        raise ConfigError(
            f"{setting}: {redact(url)!r} has scheme {scheme!r}; did you mean {close[0]!r}? "
            f"Write it as '{close[0]}://...'."
        )


def _scheme(url: Any) -> str:
    if not isinstance(url, str) or "://" not in url:
        return ""
    return url.split("://", 1)[0].split("+", 1)[0].lower()


def check_urls(urls: Any, setting: str = "dlock_urls") -> tuple[str, ...]:
    """Validate a URL list: a non-empty list, then what the backend its scheme names checks."""
    if isinstance(urls, str):
        urls = [urls]
    if not isinstance(urls, Sequence) or isinstance(urls, bytes):
        raise ConfigError(
            f"{setting} must be a list of Redis URLs, not {type(urls).__name__} ({urls!r})."
        )
    if not urls:
        raise ConfigError(
            f"{setting} is empty: give one Redis URL for a single instance, or three or more "
            "independent masters for Redlock."
        )
    checked: tuple[str, ...] = backend_module(urls, setting).check_urls(tuple(urls), setting)
    return checked


def check_seconds(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """A positive (or non-negative) finite number of seconds, else a ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number of seconds, not {value!r}.")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be {bound} seconds, got {value!r}.")
    return seconds


def check_key(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(
            f"lock key must be a str, not {type(key).__name__} ({key!r}); build it with an "
            'f-string, e.g. f"meta:{source}:{entity}".'
        )
    if not key:
        raise ConfigError("lock key is empty; give a name such as 'replicate' or 'meta:s:e'.")
    surrogate = None if key.isascii() else next((c for c in key if "\ud800" <= c <= "\udfff"), None)
    if surrogate is not None:
        raise ConfigError(
            f"lock key {key[:60]!r} holds a lone surrogate ({surrogate!r} at "
            f"{key.index(surrogate)}), which "
            "no lock store can encode; kombu's JSON turns a '\\ud800' escape into one. Clean "
            "the value first (e.g. text.encode('utf-8', 'replace').decode())."
        )
    if key.startswith("}"):
        # Redis keys are prefix:{key}: a '}' right after the '{' makes an empty hash tag, so
        # Redis Cluster would hash the lock's keys (lock, counter, signal) to different slots.
        raise ConfigError(
            f"lock key {key[:60]!r} starts with '}}', which would end its Redis Cluster hash "
            "tag before it begins; start it with another character (e.g. 'k:' + key)."
        )
    if len(key) > MAX_KEY_LENGTH:
        raise ConfigError(
            f"lock key is {len(key)} characters, over the {MAX_KEY_LENGTH} limit; hash the "
            f"variable part (hashlib.sha256(...).hexdigest()). Key starts {key[:60]!r}."
        )
    return key


def drift(ttl: float, factor: float = DEFAULT_DRIFT_FACTOR) -> float:
    """Clock drift allowance: a fraction of the ttl plus 2 ms for timer granularity."""
    return ttl * factor + 0.002


def check_ttl(name: str, ttl: Any, factor: float = DEFAULT_DRIFT_FACTOR) -> float:
    """A ttl long enough to outlast its own drift allowance."""
    seconds = check_seconds(name, ttl)
    if seconds - drift(seconds, factor) < MIN_VALIDITY:
        raise ConfigError(
            f"{name} ({seconds:g} s) is too short: after the clock drift allowance "
            f"({drift(seconds, factor) * 1000:.1f} ms) less than {MIN_VALIDITY * 1000:g} ms of "
            "validity would be left. Use at least 0.1 s; seconds are usual."
        )
    return seconds


def check_renew_interval(
    renew_interval: Any, ttl: float, factor: float = DEFAULT_DRIFT_FACTOR
) -> float:
    """``renew_interval`` must leave time to renew before the lease runs out; default ttl / 3."""
    if renew_interval is None:
        return ttl / 3.0
    interval = check_seconds("renew_interval", renew_interval)
    validity = ttl - drift(ttl, factor)
    if interval >= validity:
        raise ConfigError(
            f"renew_interval ({interval:g} s) must be shorter than the ttl ({ttl:g} s) less "
            f"its drift allowance ({validity:g} s), or the lease runs out before it is renewed; "
            f"about a third of the ttl ({ttl / 3:g} s) is usual."
        )
    if interval > ttl / 2:
        warnings.warn(
            f"renew_interval ({interval:g} s) is over half the ttl ({ttl:g} s): a renewal that "
            "fails once cannot be retried before the lease runs out. About ttl/3 is usual.",
            DLockConfigWarning,
            stacklevel=3,
        )
    return interval


@dataclass(frozen=True)
class Settings:
    """The validated ``dlock_*`` settings one lock manager runs with."""

    urls: tuple[str, ...]
    ttl: float = DEFAULT_TTL
    prefix: str = DEFAULT_PREFIX
    node_timeout: float = DEFAULT_NODE_TIMEOUT
    drift_factor: float = DEFAULT_DRIFT_FACTOR
    fence_retention: float = DEFAULT_FENCE_RETENTION

    def __post_init__(self) -> None:
        object.__setattr__(self, "urls", check_urls(self.urls))
        object.__setattr__(self, "ttl", check_ttl("dlock_ttl", self.ttl))
        object.__setattr__(
            self, "node_timeout", check_seconds("dlock_node_timeout", self.node_timeout)
        )
        object.__setattr__(
            self, "fence_retention", check_seconds("dlock_fence_retention", self.fence_retention)
        )
        drift = self.drift_factor
        if isinstance(drift, bool) or not isinstance(drift, int | float) or not 0 <= drift < 0.5:
            raise ConfigError(
                f"dlock_drift_factor must be a fraction in [0, 0.5), got {drift!r}; 0.01 "
                "(1 % of the ttl) suits NTP-disciplined clocks."
            )
        if not isinstance(self.prefix, str) or not self.prefix or "{" in self.prefix:
            raise ConfigError(
                f"dlock_prefix must be a non-empty string without '{{', got {self.prefix!r}."
            )


#: Every ``dlock_*`` setting there is; any other is refused, so that a misspelt one
#: (``dlock_url``) cannot quietly leave the locks on the broker's Redis.
SETTINGS = (
    "dlock_urls",
    "dlock_ttl",
    "dlock_prefix",
    "dlock_node_timeout",
    "dlock_drift_factor",
    "dlock_fence_retention",
    "dlock_beat_ttl",
    "dlock_beat_key",
)
DEFAULT_BEAT_TTL = 10.0


def check_setting_names(conf: Any, namespace: str | None = None) -> None:
    """Refuse every ``dlock_*`` setting this library does not have, and every one Celery does
    not read, all in one error, each named as the user wrote it with the name to write.

    ``namespace`` is the app's (``config_from_object(..., namespace="CELERY")``, Django's
    usual): Celery then reads ``CELERY_DLOCK_URLS`` (and ``dlock_urls`` set on ``app.conf``),
    so a ``DLOCK_URLS`` without the prefix is ignored, and a hint must name the prefixed form.
    """
    problems = misnamed_settings(conf, namespace)
    if problems:
        raise ConfigError(f"{'; '.join(problems)}. The settings are {', '.join(SETTINGS)}.")


def misnamed_settings(conf: Any, namespace: str | None = None) -> list[str]:
    """One line per ``dlock_*`` setting of ``conf`` that is misspelt or not read by Celery."""
    try:
        names = [str(name) for name in conf]
    except Exception:  # a configuration object that cannot list its keys: nothing to check
        return []
    prefix = f"{namespace.rstrip('_')}_" if namespace else ""
    problems: list[str] = []
    for name in sorted(set(names)):
        lowered = name.lower()
        has_prefix = bool(prefix) and lowered.startswith(prefix.lower())
        bare = lowered[len(prefix) :] if has_prefix else lowered
        django_style = not prefix and bare.startswith("celery_dlock_")
        bare = bare.removeprefix("celery_") if django_style else bare
        if not bare.startswith("dlock_"):
            continue
        known = bare in SETTINGS
        close = bare if known else next(iter(difflib.get_close_matches(bare, SETTINGS, n=1)), "")
        # The name Celery looks up: the namespaced one, unless set lowercase on app.conf.
        namespaced = has_prefix or (bool(prefix) and name != lowered)
        wanted = _match_case(prefix + close, prefix) if namespaced else close
        if known and name == wanted:
            continue
        if not known:
            hint = f" (did you mean {wanted!r}?)" if close else ""
            problems.append(f"setting {name!r} is not a celery_dlock setting{hint}")
            continue
        if prefix:
            why = f"this app reads its settings with namespace={namespace!r}, so "
        elif django_style:
            why = (
                "Celery reads CELERY_-prefixed settings only with config_from_object(..., "
                "namespace='CELERY'); without a namespace "
            )
        else:
            why = ""
        problems.append(f"setting {name!r} is ignored: {why}Celery looks for {wanted!r}")
    return problems


def _match_case(name: str, like: str) -> str:
    """``name`` in the case of ``like`` by Celery's rule for a namespaced setting's name
    (``celery.utils.text.match_case``): upper case for an upper-case namespace, else lower
    case, so that ``namespace="Celery"`` reads ``celery_dlock_urls``."""
    return name.upper() if like.isupper() else name.lower()


def beat_settings(app: Any) -> tuple[str, float]:
    """The leader-elected scheduler's lock key and lease ttl, checked."""
    conf = app.conf
    key = conf.get("dlock_beat_key") or f"beat-leader:{app.main or 'celery'}"
    if not isinstance(key, str):
        raise ConfigError(f"dlock_beat_key must be a str, not {key!r}.")
    ttl = check_ttl("dlock_beat_ttl", conf.get("dlock_beat_ttl", DEFAULT_BEAT_TTL))
    return check_key(key), ttl


def broker_url(conf: Any) -> Any:
    """The broker URL as Celery reads it: ``CELERY_BROKER_URL`` from the environment first
    (``celery -b`` sets it too), then the ``broker_url`` setting; None when neither is set."""
    try:
        return conf.broker_url  # Celery's Settings: a property that reads the environment
    except AttributeError:  # a plain mapping
        return conf.get("broker_url")


def broker_lock_urls(conf: Any) -> list[str]:
    """The lock URL the broker setting gives when ``dlock_urls`` is not set."""
    broker = broker_url(conf) or ""
    shown = redact(str(broker)) or "unset"
    scheme = broker.split("://", 1)[0].lower() if isinstance(broker, str) else ""
    if ";" in str(broker) and scheme != "sentinel":
        raise ConfigError(
            f"dlock_urls is not set and the broker URL is a failover list ({shown}), which a "
            "lock cannot follow; set app.conf.dlock_urls = ['redis://host:6379/0'] (or three "
            "or more independent masters for Redlock)."
        )
    if scheme in ("redis", "rediss"):
        rest = broker.split("://", 1)[1]
        # kombu reads a bare redis:// as the local default server
        return [broker if rest.strip("/") else f"{scheme}://localhost:6379/0"]
    if scheme == "redis+socket":  # kombu's Unix-socket Redis
        return ["unix://" + broker.split("://", 1)[1]]
    if scheme == "sentinel":
        return [sentinel_url_from_kombu(broker, conf.get("broker_transport_options") or {})]
    raise ConfigError(
        f"dlock_urls is not set and the broker is not Redis ({shown}); set "
        "app.conf.dlock_urls = ['redis://host:6379/0'] (or three or more URLs for Redlock)."
    )


def settings_from_app(app: Any, fallback: tuple[Any, str] | None = None) -> Settings:
    """Read the ``dlock_*`` settings of a Celery app; ``dlock_urls`` falls back to
    ``fallback`` (URLs and the setting they came from, for its errors), then the broker."""
    conf = app.conf
    check_setting_names(conf, getattr(app, "namespace", None))
    urls = conf.get("dlock_urls")
    setting = "dlock_urls"
    if urls is None and fallback is not None:
        urls, setting = fallback
    if urls is None:
        urls = broker_lock_urls(conf)
        setting = "broker_url (used as dlock_urls is not set)"
    return Settings(
        urls=check_urls(urls, setting),
        ttl=conf.get("dlock_ttl", DEFAULT_TTL),
        prefix=conf.get("dlock_prefix", DEFAULT_PREFIX),
        node_timeout=conf.get("dlock_node_timeout", DEFAULT_NODE_TIMEOUT),
        drift_factor=conf.get("dlock_drift_factor", DEFAULT_DRIFT_FACTOR),
        fence_retention=conf.get("dlock_fence_retention", DEFAULT_FENCE_RETENTION),
    )


def sentinel_url_from_kombu(broker: str, transport_options: Any) -> str:
    """Celery's Sentinel broker setting as one ``redis+sentinel://`` URL.

    Kombu spells it ``sentinel://:pw@host:26379/0;sentinel://host2:26379`` with the group name
    in ``broker_transport_options["master_name"]`` and the sentinels' own password, if any, in
    ``broker_transport_options["sentinel_kwargs"]["password"]``.
    """
    master = transport_options.get("master_name")
    if not master:
        raise ConfigError(
            f"dlock_urls is not set and the broker is Sentinel ({redact(broker)}) without "
            "broker_transport_options['master_name']; set it, or set app.conf.dlock_urls = "
            "['redis+sentinel://host:26379,host2:26379/mymaster/0']."
        )
    hosts: list[str] = []
    auth = db = ""
    for part in filter(None, (p.strip() for p in broker.split(";"))):
        rest = part.split("://", 1)[-1]
        userinfo, _, hostpath = rest.rpartition("@")
        auth = auth or (f"{userinfo}@" if userinfo else "")
        host, _, path = hostpath.partition("/")
        hosts.append(host)
        db = db or path.strip("/")
    query = ""
    sentinel_password = (transport_options.get("sentinel_kwargs") or {}).get("password")
    if sentinel_password:
        query = "?" + urlencode({"sentinel_password": sentinel_password})
    return f"redis+sentinel://{auth}{','.join(hosts)}/{master}/{db or 0}{query}"
