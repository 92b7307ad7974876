"""Settings: read once from ``app.conf`` (or given as URLs), validated, with clear errors.

Every ``dlock_*`` setting is optional except where no lock URL can be found at all:

================================  ===========  ==============================================
setting                           default      meaning
================================  ===========  ==============================================
``dlock_urls``                    broker URL   one URL = single Redis; three or more = Redlock;
                                               one ``zookeeper://h1,h2,h3/chroot`` = ZooKeeper
``dlock_ttl``                     30           lease length in seconds, renewed while held
``dlock_prefix``                  ``"dlock"``  prefix of every key the library writes
``dlock_node_timeout``            0.5          seconds one lock node may take to answer
``dlock_drift_factor``            0.01         clock drift allowance, as a fraction of the ttl
``dlock_fence_retention``         86400        seconds a key's fence counter is kept unused
================================  ===========  ==============================================
"""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery_dlock.core.errors import ConfigError
from celery_dlock.core.urls import check_urls

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


class DLockConfigWarning(UserWarning):
    """A setting works but is probably not what was meant (e.g. an even number of nodes)."""


def quorum(n: int) -> int:
    """Nodes that must agree: a strict majority."""
    return n // 2 + 1


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


#: Reads an app's configuration for lock URLs when ``dlock_urls`` is not set: the URLs and the
#: setting they came from (named in their errors). The Celery layer sets it
#: (:func:`celery_dlock.celery.broker.broker_lock_urls`, the broker URL as kombu spells it):
#: the core knows no broker.
_default_urls: Callable[[Any], tuple[list[str], str]] | None = None


def use_default_urls(read: Callable[[Any], tuple[list[str], str]]) -> None:
    """Make ``read(conf)`` the source of an app's lock URLs when ``dlock_urls`` is not set."""
    global _default_urls
    _default_urls = read


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
        if _default_urls is None:  # no Celery layer imported: nothing else to read
            raise ConfigError(
                "dlock_urls is not set; set app.conf.dlock_urls = ['redis://host:6379/0'] (or "
                "three or more URLs for Redlock)."
            )
        urls, setting = _default_urls(conf)
    return Settings(
        urls=check_urls(urls, setting),
        ttl=conf.get("dlock_ttl", DEFAULT_TTL),
        prefix=conf.get("dlock_prefix", DEFAULT_PREFIX),
        node_timeout=conf.get("dlock_node_timeout", DEFAULT_NODE_TIMEOUT),
        drift_factor=conf.get("dlock_drift_factor", DEFAULT_DRIFT_FACTOR),
        fence_retention=conf.get("dlock_fence_retention", DEFAULT_FENCE_RETENTION),
    )
