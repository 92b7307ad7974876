"""The in-process backend, for tests: ``dlock_urls = ["memory://"]`` (or ``memory://<name>``
for a table of its own).

Locks live in this process's memory (:mod:`.store`), behind the same
:class:`celery_dlock.core.backend.Backend` contract as Redis and ZooKeeper (:mod:`.lock`): a test of
your tasks runs without any server, and freezegun's ``freeze_time(...).tick()`` moves a lease
to its expiry. It is **not** a lock between processes: a prefork worker of more than one process
is refused when it starts (:func:`check_worker`), and a process forked after the table's first
use cannot take keys in it. Never use it in production.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from celery_dlock.backends.memory.lock import MemoryBackend
from celery_dlock.backends.memory.store import Store, store
from celery_dlock.core.backend import Backend
from celery_dlock.core.config import Settings
from celery_dlock.core.errors import ConfigError
from celery_dlock.core.urls import redact

__all__ = ["MemoryBackend", "Store", "check_urls", "check_worker", "make_backend", "store"]

_NAME = re.compile(r"[A-Za-z0-9._-]{0,100}")


def table_name(url: str, setting: str = "dlock_urls") -> str:
    """The table a ``memory://[name]`` URL names ("" for the default one)."""
    rest = url.split("://", 1)[1] if "://" in url else ""
    name = rest.rstrip("/")
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"{setting}: {redact(url)!r} is not an in-process lock table: write 'memory://' "
            "or 'memory://<name>' with a name of letters, digits, '.', '_' or '-' (no host, "
            "password or options: nothing leaves this process)."
        )
    return name


def check_urls(urls: Sequence[str], setting: str = "dlock_urls") -> tuple[str, ...]:
    """What :mod:`celery_dlock.core.config` asks of a backend module: the URLs, checked. One
    ``memory://`` URL names one table in this process."""
    if len(urls) != 1:
        shown = ", ".join(repr(redact(url)) for url in urls)
        raise ConfigError(
            f"{setting} has {len(urls)} memory URLs ({shown}): an in-process table is one "
            "node; give one, e.g. ['memory://']."
        )
    table_name(urls[0], setting)
    return tuple(urls)


def make_backend(settings: Settings) -> Backend:
    """The in-process backend for settings whose URL :func:`check_urls` accepted."""
    return MemoryBackend(settings, store(table_name(settings.urls[0])))


#: The names a prefork pool goes by (``--pool``, ``worker_pool``), and its class's module.
_PREFORK = ("prefork", "processes", "celery.concurrency.prefork")


def check_worker(urls: Sequence[str], pool: str, concurrency: Any) -> None:
    """Refuse a worker whose tasks would run in several processes, each with its own table:
    nothing would stop two of them from holding one key. ``pool`` is the pool's name or its
    class's module; ``concurrency`` the worker's (an int, ``"auto"`` or None)."""
    name = pool.lower().split(":", 1)[0]
    if not any(name == p or name.startswith(p + ".") for p in _PREFORK):
        return
    if isinstance(concurrency, int) and not isinstance(concurrency, bool) and concurrency <= 1:
        return
    shown = ", ".join(repr(redact(url)) for url in urls)
    raise ConfigError(
        f"dlock_urls ({shown}) keeps locks in one process's memory, but this worker runs "
        f"tasks in a prefork pool of {concurrency!r} processes, each with its own copy: two "
        "of them could hold one key at once. Start it with --concurrency 1, or --pool solo "
        "or threads (or gevent/eventlet), or use a real lock store for several processes "
        "(dlock_urls = ['redis://127.0.0.1:6379/0'])."
    )
