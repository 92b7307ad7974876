"""celery-singleton's and celery-once's task options, which ``SingletonTask`` does not read.

Left in a half-migrated task they would be ignored without a word, so ``SingletonTask`` refuses
them, per task and per call, each with what to write instead (or the drop-in class that reads
it). This module holds what the peers' options mean; importing it gives the table to
``SingletonTask`` (``celery_dlock/__init__`` does, so every task class is checked against it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from celery_dlock.celery.task import SingletonTask


def _unique_on(value: Any) -> str:
    # celery-singleton 0.3.1: a string is one name, an empty list the task name alone.
    if isinstance(value, str):
        names: list[str] | None = [value]
    else:
        names = list(value) if isinstance(value, list | tuple) else None
    fix = "lock_key=None (every argument)" if names is None else f"lock_key={names!r}"
    return (
        f"celery-singleton, which SingletonTask does not read: write {fix} instead, or use "
        "base=celery_dlock.compat.Singleton, which reads it"
    )


def _raise_on_duplicate(value: Any) -> str:
    return (
        "celery-singleton, which SingletonTask does not read: a duplicate .delay() cannot "
        "raise here; with lock_on='enqueue' compare the id you get back (the delay_once "
        "recipe), or use on_duplicate='raise' to fail the duplicate in the worker, or use "
        "base=celery_dlock.compat.Singleton, which reads it"
    )


def _lock_expiry(value: Any) -> str:
    return (
        "celery-singleton, which SingletonTask does not read: write lock_queued_ttl= for the "
        "time a message waits in the queue and lock_ttl= for the lease while it runs (renewed, "
        "so it need not cover the run), or use base=celery_dlock.compat.Singleton, which reads it"
    )


def _once(value: Any) -> str:
    parts = ["lock_on='enqueue'"]
    if isinstance(value, Mapping):
        if "keys" in value:
            parts.append(f"lock_key={list(value['keys'])!r}")
        if "timeout" in value:
            parts.append(f"lock_queued_ttl={value['timeout']!r}")
    extra = ""
    if isinstance(value, Mapping) and value.get("unlock_before_run"):
        extra = "; unlock_before_run has no equivalent (on_duplicate='requeue' comes closest)"
    return (
        "celery-once, which SingletonTask does not read: write "
        f"@app.task(base=SingletonTask, {', '.join(parts)}) instead, per task (a duplicate "
        f"gets the queued task's result, as with graceful=True){extra}, or use "
        "base=celery_dlock.compat.QueueOnce, which reads it"
    )


#: celery-singleton's and celery-once's options -> what to write instead (given the value).
PEER_OPTIONS: Mapping[str, Callable[[Any], str]] = {
    "unique_on": _unique_on,
    "raise_on_duplicate": _raise_on_duplicate,
    "lock_expiry": _lock_expiry,
    "once": _once,
}


SingletonTask._peer_options = PEER_OPTIONS
