"""The Redis backend: one Redis, Redlock over several masters, Sentinel, or Redis Cluster.

What :mod:`celery_dlock.core.config` asks of a backend module: :func:`check_urls` and
:func:`make_backend`. The lock itself is :class:`~.redlock.LockManager`; the modules below it,
from the wire up: :mod:`.endpoints` (URLs, redis-py clients), :mod:`.scripts` (the Lua),
:mod:`.nodes` (a node and its connections), :mod:`.failover` (Sentinel's announcements),
:mod:`.connecting` (connects, stale connections), :mod:`.owed` (a command packed, a
reply read, replies still owed, ``CLIENT REPLY SKIP``),
:mod:`.resends` (reply-less releases not yet confirmed), :mod:`.sending` (scripts sent without
waiting), :mod:`.transport` (one command to N nodes), :mod:`.cluster` (Cluster routing),
:mod:`.diagnose` (what an error means), :mod:`.janitor` (deletes owed to silent nodes),
:mod:`.decisions` (what replies decide), :mod:`.ending` (release, hand-over), :mod:`.renewing`
(renewal), :mod:`.inspection` (the operator's reads and repairs).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from celery_dlock.backends.redis import endpoints
from celery_dlock.backends.redis.redlock import LockManager
from celery_dlock.core.backend import Backend
from celery_dlock.core.config import DLockConfigWarning, Settings, quorum
from celery_dlock.core.errors import ConfigError
from celery_dlock.core.urls import redact

__all__ = ["LockManager", "check_urls", "make_backend"]


def check_urls(urls: Sequence[str], setting: str = "dlock_urls") -> tuple[str, ...]:
    """Redis URLs, checked: well-formed, one URL per server, a Cluster alone, never exactly two."""
    seen: dict[tuple[str, ...], str] = {}
    for url in urls:
        endpoint = endpoints.parse(url, setting)
        if endpoint.kind == "cluster" and len(urls) > 1:
            raise ConfigError(
                f"{setting}: {endpoint.shown!r} is a Redis Cluster, which is one lock node; give "
                f"it as the only {setting} entry (the cluster spreads keys over its masters), "
                "or list independent masters (redis://...) for Redlock."
            )
        ident = endpoint.identity()
        if ident in seen:
            raise ConfigError(
                f"{setting}: {redact(url)!r} and {redact(seen[ident])!r} name the same Redis "
                "server; Redlock needs independent masters (different databases of one server "
                "fail together)."
            )
        seen[ident] = url
    n = len(urls)
    if n == 2:
        raise ConfigError(
            f"{setting} has two URLs: a Redlock quorum is 2 of 2, so losing either node stops "
            "every lock; it survives no failure. Use one URL (single Redis) or three or more."
        )
    if n > 2 and n % 2 == 0:
        warnings.warn(
            f"{setting} has {n} nodes: the quorum is {quorum(n)}, which tolerates "
            f"{n - quorum(n)} failed node(s), no more than {n - 1} nodes would. An odd count "
            "gives the same safety for fewer servers.",
            DLockConfigWarning,
            stacklevel=4,
        )
    return tuple(urls)


def make_backend(settings: Settings) -> Backend:
    """The Redis backend for settings whose URLs :func:`check_urls` accepted."""
    return LockManager(settings)
