"""What one ``dlock_urls`` entry names, and the redis-py client that reaches it.

Three kinds of entry, each one lock *node* (Redlock counts each entry as one vote):

* ``redis://``, ``rediss://`` (TLS), ``unix://`` — one Redis server;
* ``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]`` (``rediss+sentinel``
  for TLS) — the current master of a Sentinel-managed group, found through the sentinels
  (redis-py's ``Sentinel.master_for``); ``?sentinel_password=`` / ``?sentinel_username=`` when
  the sentinels themselves require them;
* ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster``) — a Redis
  Cluster, from any of its nodes; keys are routed by hash slot.

Query options (``?ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...``, ``socket_keepalive=...``)
are redis-py's own, parsed by redis-py. Passwords never leave this module unredacted.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from redis.connection import Connection, parse_url

from celery_dlock.core.errors import ConfigError
from celery_dlock.core.urls import (
    CERT_REQS,
    PERCENT_ENCODE,
    TLS_FILES,
    misread_userinfo,
    redact,
    secret_option,
    tls_file_problem,
)

PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SCHEMES = PLAIN_SCHEMES + SENTINEL_SCHEMES + CLUSTER_SCHEMES
DEFAULT_SENTINEL_PORT = 26379
#: Query options that configure the sentinels rather than the master.
SENTINEL_OPTIONS = ("sentinel_password", "sentinel_username")

FIX = (
    "use redis://host:6379/0, rediss:// for TLS, unix:///path/to/socket, "
    "redis+sentinel://host:26379,host2:26379/service_name/0 for Sentinel, "
    "redis+cluster://host:7000,host2:7001 for Redis Cluster, or "
    "zookeeper://host1:2181,host2:2181,host3:2181/chroot for ZooKeeper"
)


@dataclass(frozen=True)
class Endpoint:
    """One ``dlock_urls`` entry, parsed and checked (see the module docstring)."""

    url: str
    kind: str  # "redis", "sentinel" or "cluster"
    #: The seed hosts: the sentinels, or the cluster nodes given; the server for "redis".
    hosts: tuple[tuple[str, int], ...]
    #: redis-py connection options for the server(s) that hold the keys.
    options: dict[str, Any] = field(compare=False, hash=False)
    service: str = ""  # Sentinel's name for the master group
    sentinel_options: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def shown(self) -> str:
        return redact(self.url)

    @property
    def tls(self) -> bool:
        return self.url.split(":", 1)[0].lower().startswith("rediss")

    def identity(self) -> tuple[Any, ...]:
        """What tells two entries apart: two entries with one identity are one server."""
        if self.kind == "redis":
            if "path" in self.options:
                return ("unix", self.options["path"])
            return ("tcp", self.hosts[0][0].lower(), self.hosts[0][1])
        if self.kind == "sentinel":
            return ("sentinel", self.service, frozenset(self.hosts))
        return ("cluster", frozenset(self.hosts))

    def client(self, timeout: float) -> Any:
        """A redis-py client with ``timeout`` on every socket and no redis-py retries: a
        retried connect to a hung node multiplies the time a call waits, and the lock layer
        decides what a failed node means."""
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        common = {"socket_timeout": timeout, "socket_connect_timeout": timeout, **_NO_SETINFO}
        if self.kind == "redis":
            import redis

            return redis.Redis.from_url(self.url, retry=Retry(NoBackoff(), 0), **common)
        options = {k: v for k, v in self.options.items() if k != "connection_class"}
        if self.kind == "sentinel":
            from redis.sentinel import Sentinel

            sentinel_kwargs = {**self.sentinel_options, **common, "retry": Retry(NoBackoff(), 0)}
            if self.tls:
                sentinel_kwargs.update(_tls_options(options))
                options["ssl"] = True
            sentinel = Sentinel(list(self.hosts), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
            return sentinel.master_for(  # type: ignore[no-untyped-call]
                self.service, retry=Retry(NoBackoff(), 0), **{**options, **common}
            )
        from redis.cluster import ClusterNode, RedisCluster

        options.pop("db", None)
        if self.tls:
            options["ssl"] = True
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in self.hosts],  # type: ignore[no-untyped-call]
            **{**options, **common},
        )


def _no_setinfo() -> dict[str, Any]:
    """Connection options that stop redis-py's two ``CLIENT SETINFO`` round trips per connect.

    Every thread opens its own connection to every node, so a burst of new threads (50
    publishers on Redlock-5: 250 connects at once) waits on them, and servers before 7.2
    refuse them anyway. redis-py 5.x-7.x take ``lib_name=None``; later ones ``driver_info=None``.
    """
    import inspect

    from redis.connection import AbstractConnection

    params = inspect.signature(AbstractConnection.__init__).parameters
    if "driver_info" in params:
        return {"driver_info": None}
    if "lib_name" in params:
        return {"lib_name": None, "lib_version": None}
    return {}


_NO_SETINFO = _no_setinfo()


def _tls_options(options: dict[str, Any]) -> dict[str, Any]:
    tls = {k: v for k, v in options.items() if k.startswith("ssl_")}
    tls["ssl"] = True
    return tls


def parse(url: Any, setting: str = "dlock_urls") -> Endpoint:
    """Parse one entry; a :class:`ConfigError` naming ``setting``, the URL and the fix."""
    if not isinstance(url, str):
        raise ConfigError(f"{setting}: {url!r} is a {type(url).__name__}, not a URL string.")
    shown = redact(url)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ConfigError(f"{setting}: {shown!r} is not a URL ({exc}).") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigError(f"{setting}: {shown!r} has scheme {parts.scheme!r}; {FIX}.")
    if misread_userinfo(url):
        raise ConfigError(
            f"{setting}: {shown!r} is not user:password@host as URL parsers read it (an '@' "
            f"comes after a '/', '?' or '#'); {PERCENT_ENCODE}."
        )
    if scheme in PLAIN_SCHEMES:
        return _plain(url, parts, scheme, setting, shown)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    default_port = DEFAULT_SENTINEL_PORT if scheme in SENTINEL_SCHEMES else 6379
    hosts = tuple(_host_port(h, default_port, setting, shown) for h in hostlist.split(","))
    path = [unquote(p) for p in parts.path.split("/") if p]
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    sentinel_options = {
        name.removeprefix("sentinel_"): query.pop(name)
        for name in SENTINEL_OPTIONS
        if name in query
    }
    # The connection options for the data nodes, parsed by redis-py from an equivalent URL.
    plain = "rediss" if scheme.startswith("rediss") else "redis"
    auth = f"{userinfo}@" if userinfo else ""
    host, port = hosts[0]
    if scheme in SENTINEL_SCHEMES:
        if not path:
            raise ConfigError(
                f"{setting}: {shown!r} names no Sentinel service; write "
                "redis+sentinel://host:26379,host2:26379/SERVICE_NAME/0 (the name sentinels "
                "monitor, e.g. 'mymaster')."
            )
        service, db = path[0], path[1:]
        if len(db) > 1 or (db and not db[0].isdigit()):
            raise ConfigError(
                f"{setting}: {shown!r}: after the service name the path may hold only a "
                f"database number, not {'/'.join(db)!r}."
            )
        options = _redis_options(
            f"{plain}://{auth}{host}:{port}/{db[0] if db else 0}", parts.query, query, setting
        )
        for name in ("host", "port"):
            options.pop(name, None)
        return Endpoint(url, "sentinel", hosts, options, service, sentinel_options)
    if path and path != ["0"]:
        raise ConfigError(
            f"{setting}: {shown!r} names database {'/'.join(path)!r}; Redis Cluster has only "
            "database 0: write redis+cluster://host:port,host2:port."
        )
    options = _redis_options(f"{plain}://{auth}{host}:{port}/0", parts.query, query, setting)
    for name in ("host", "port"):
        options.pop(name, None)
    return Endpoint(url, "cluster", hosts, options)


@functools.cache
def _connection_options(connection_class: type) -> frozenset[str]:
    """The keyword arguments a redis-py connection class (and its bases) accepts."""
    names: set[str] = set()
    for cls in connection_class.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        names.update(
            p.name
            for p in parameters
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
        )
    return frozenset(names | {"path"})


def _plain(url: str, parts: Any, scheme: str, setting: str, shown: str) -> Endpoint:
    if scheme == "unix":
        if not parts.path:
            raise ConfigError(f"{setting}: {shown!r} names no socket path (unix:///path).")
        return Endpoint(url, "redis", (), _redis_options(url, "", {}, setting))
    if "," in parts.netloc:
        raise ConfigError(
            f"{setting}: {shown!r} lists several hosts in one URL; give each Redlock node its "
            "own URL, or use redis+sentinel:// or redis+cluster:// for a group of servers."
        )
    if not parts.hostname:
        raise ConfigError(f"{setting}: {shown!r} names no host; write redis://host:6379/0.")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ConfigError(f"{setting}: {shown!r} has a port that is not a number.") from None
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ConfigError(
            f"{setting}: {shown!r} has database {unquote(db)!r}; the path must be a number."
        )
    options = _redis_options(url, "", {}, setting)
    return Endpoint(url, "redis", ((parts.hostname, port),), options)


def _host_port(text: str, default: int, setting: str, shown: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ConfigError(f"{setting}: {shown!r} has an empty host in its host list.")
    if not sep:
        return host, default
    if not port.isdigit():
        raise ConfigError(f"{setting}: {shown!r} has port {port!r}, which is not a number.")
    return host, int(port)


def _split_secret(url: str, option: str) -> bool:
    """Whether ``option`` (an unknown one) is a query piece without ``=`` after a secret
    option: most likely the rest of a password that held a raw ``&``, not to be shown."""
    bare = re.search(rf"&{re.escape(option)}(?:&|#|$)", url)
    return bare is not None and any(
        secret_option(name) for name in re.findall(r"[?&]([^=&#]+)=", url[: bare.start()])
    )


def _redis_options(url: str, raw_query: str, query: dict[str, str], setting: str) -> dict[str, Any]:
    """redis-py's own reading of the URL (options, credentials, TLS class)."""
    if raw_query:
        url = f"{url}?{urlencode(query)}" if query else url
    try:
        options = dict(parse_url(url))  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise ConfigError(f"{setting}: {redact(url)!r}: {exc}") from None
    known = _connection_options(options.get("connection_class", Connection))
    unknown = sorted(k for k in options if k not in known and k != "connection_class")
    if unknown and _split_secret(url, unknown[0]):
        raise ConfigError(
            f"{setting}: {redact(url)!r}: a password option is followed by a piece without "
            "'=': a raw '&' in a password ends it; percent-encode '&' as %26 (and '#' as %23)."
        )
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{setting}: {redact(url)!r} has query option {unknown[0]!r}, which redis-py's "
            f"connections do not take (options are redis-py's: socket_timeout, ssl_ca_certs, "
            f"...).{hint}"
        )
    reqs = options.get("ssl_cert_reqs")
    if isinstance(reqs, str) and reqs not in CERT_REQS:
        close = difflib.get_close_matches(reqs.lower(), CERT_REQS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"{setting}: {redact(url)!r}: ssl_cert_reqs={reqs!r} is not one of "
            f"{', '.join(CERT_REQS)}; {hint}'required' (the default) checks the server's "
            "certificate."
        )
    for name in TLS_FILES:  # checked when the URL is parsed, not at the first connection
        path = options.get(name)
        problem = tls_file_problem(name, path) if isinstance(path, str) else None
        if problem is not None:
            raise ConfigError(f"{setting}: {redact(url)!r}: {problem[0]}; {problem[1]}")
    return options
