"""One command on one connection: packed for the wire, its reply read, and what a reply says.

The lowest layer of the Redis transport; every other module that writes to a connection packs
and reads through these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from celery_dlock.backends.redis.nodes import Connection, Reply

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:  # redis-py's own serializer wraps this C packer in Python that costs more than it does
    import hiredis

    _hiredis_pack = hiredis.pack_command
except ImportError:  # pragma: no cover - hiredis is optional (the "fast" extra)
    _hiredis_pack = None


def pack(conn: Connection, command: tuple[Any, ...]) -> Any:
    """``command`` in the wire protocol, for ``send_packed_command``.

    hiredis packs str, bytes and numbers exactly as redis-py does; anything else, or no
    hiredis, goes through the connection's own serializer.
    """
    if _hiredis_pack is not None:
        try:
            return [_hiredis_pack(command)]  # a list: a bare bytes object would be iterated
        except TypeError:
            pass
    return conn.pack_command(*command)


def read(conn: Connection) -> Reply:
    """One reply, or the exception that stands in for it."""
    try:
        return conn.read_response()
    except (RedisError, OSError) as exc:
        return exc


def demoted(reply: Reply) -> bool:
    """True for a reply that says the server is no longer a master: redis-py's own conversion
    of ``READONLY`` (Redis 7) or the ``ResponseError`` a script gets on Redis 6.2."""
    if isinstance(reply, ResponseError):
        return "READONLY" in str(reply)
    return isinstance(reply, RedisConnectionError) and "now a slave" in str(reply)
