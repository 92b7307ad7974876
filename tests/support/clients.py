"""Plain redis-py clients for tests to look at and poke the servers, closed at session end."""

from __future__ import annotations

import redis

_clients: dict[str, redis.Redis] = {}


def client(url: str) -> redis.Redis:
    """A shared client for ``url`` (it reconnects by itself after a server restart)."""
    found = _clients.get(url)
    if found is None:
        found = _clients[url] = redis.Redis.from_url(url)
    return found


def idle_timeout(url: str, seconds: int) -> None:
    """``CONFIG SET timeout`` on a connection of its own: with a timeout set, the shared client
    may have idled past it meanwhile and been closed by the server."""
    with redis.Redis.from_url(url) as fresh:
        fresh.config_set("timeout", seconds)


def close_all() -> None:
    for found in _clients.values():
        found.close()
    _clients.clear()
