"""What the waiter tests read off a Redis server, and the waiting thread they start."""

from __future__ import annotations

import threading
import time
from typing import Any

import redis


def command_counts(plain: redis.Redis) -> dict[str, int]:
    """Calls per command the server has run (``INFO commandstats``; a script's own calls
    included), by lower-case command name."""
    stats = plain.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(stat["calls"]) for name, stat in stats.items()}


def commands_since(plain: redis.Redis, before: dict[str, int]) -> dict[str, int]:
    """The commands run since ``before`` (a :func:`command_counts`), those with none left out."""
    after = command_counts(plain)
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def taking_thread(manager: Any, key: str, **acquire: Any) -> tuple[threading.Thread, list[float]]:
    """A thread, not yet started, that takes ``key`` (``manager.acquire(key, **acquire)``),
    notes when it got it (monotonic, in the list returned beside it) and releases it."""
    got: list[float] = []

    def take() -> None:
        lease = manager.acquire(key, **acquire)
        got.append(time.monotonic())
        lease.release()

    return threading.Thread(target=take), got
