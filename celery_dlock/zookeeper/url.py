"""``zookeeper://`` URLs: the ensemble, the chroot, digest credentials and the session timeout.

::

    zookeeper://h1:2181,h2:2181,h3:2181/celery-dlock
    zookeeper://user:secret@h1:2181,h2:2181/celery-dlock?timeout=10

The host list is kazoo's connect string (https://kazoo.readthedocs.io/en/latest/api/client.html);
the path is the chroot under which every lock node lives (default ``/celery-dlock``);
``user:password`` is ZooKeeper digest authentication, and the nodes are then created with an ACL
that only that user may change; ``timeout`` is the session timeout asked of the servers, in
seconds (the servers may grant another within their ``minSessionTimeout``/``maxSessionTimeout``).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote

from celery_dlock.errors import ConfigError

SCHEME = "zookeeper"
DEFAULT_PORT = 2181
DEFAULT_CHROOT = "/celery-dlock"
#: Session timeout asked for when the URL names none (seconds).
DEFAULT_TIMEOUT = 10.0
OPTIONS = ("timeout",)

_HOST = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9_.-]+))(?::(?P<port>\d*))?$")
_NODE_NAME = re.compile(r"^[^\x00-\x1f\x7f]+$")


@dataclass(frozen=True)
class ZkUrl:
    """One parsed ``zookeeper://`` URL."""

    hosts: tuple[tuple[str, int], ...]
    chroot: str = DEFAULT_CHROOT
    timeout: float = DEFAULT_TIMEOUT
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def connect_string(self) -> str:
        """``host:port,host:port`` for kazoo (no chroot: paths carry it, see the lock core)."""
        return ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.hosts)

    @property
    def shown(self) -> str:
        """The URL with any password hidden, for logs and errors."""
        who = f"{self.user}:***@" if self.user is not None else ""
        return f"{SCHEME}://{who}{self.connect_string}{self.chroot}"

    def client_key(self) -> tuple[str, str | None, str | None, float]:
        """What one shared client serves: the same servers, credentials and timeout."""
        return (self.connect_string, self.user, self.password, self.timeout)


def is_zookeeper(url: object) -> bool:
    """True for a ``zookeeper://`` URL (the setting selects this backend by its scheme)."""
    return isinstance(url, str) and url.lower().startswith(f"{SCHEME}://")


def _redact(url: str) -> str:
    head, sep, rest = url.partition("://")
    if "@" in rest.split("/", 1)[0]:
        userinfo, _, hosts = rest.rpartition("@")
        return f"{head}{sep}{userinfo.split(':', 1)[0]}:***@{hosts}"
    return url


def _hosts(netloc: str, bad: Callable[[str, str], ConfigError]) -> list[tuple[str, int]]:
    """The ``host:port`` list of a URL, each checked, none twice."""
    hosts: list[tuple[str, int]] = []
    for item in netloc.split(","):
        match = _HOST.match(item.strip())
        if not item.strip() or match is None:
            raise bad(
                f"{item!r} is not host or host:port",
                "separate servers with commas, e.g. 'h1:2181,h2:2181' ([::1]:2181 for IPv6).",
            )
        host = match.group("v6") or match.group("name")
        port_text = match.group("port")
        port = DEFAULT_PORT if not port_text else int(port_text)
        if not 0 < port < 65536:
            raise bad(f"port {port_text} of {item!r} is out of range", "use 1-65535 (2181).")
        if (host, port) in hosts:
            raise bad(f"{item} is listed twice", "name each server of the ensemble once.")
        hosts.append((host, port))
    return hosts


def parse(url: object, setting: str = "dlock_urls") -> ZkUrl:
    """Parse and check ``url``; :class:`ConfigError` names ``setting``, the value and the fix."""
    if not isinstance(url, str):
        raise ConfigError(
            f"{setting}: a ZooKeeper URL must be a str, not {type(url).__name__} ({url!r}); "
            "e.g. 'zookeeper://h1:2181,h2:2181,h3:2181/celery-dlock'."
        )
    shown = _redact(url)

    def bad(problem: str, fix: str) -> ConfigError:
        return ConfigError(f"{setting}: {shown!r}: {problem}; {fix}")

    if not is_zookeeper(url):
        raise bad(
            "not a zookeeper:// URL",
            "write it as 'zookeeper://host:2181,host:2181/chroot'.",
        )
    rest = url[len(SCHEME) + 3 :]
    rest, _, fragment = rest.partition("#")
    if fragment:
        raise bad("has a #fragment", "remove it.")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    user: str | None = None
    password: str | None = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        name, colon, secret = userinfo.partition(":")
        if not name or not colon or not secret:
            raise bad(
                "credentials must be user:password (ZooKeeper digest authentication)",
                "write 'zookeeper://user:password@host:2181/chroot', percent-encoding any "
                "'@', ':' or '/' in them.",
            )
        user, password = unquote(name), unquote(secret)
    if not netloc:
        raise bad("names no server", "list them: 'zookeeper://h1:2181,h2:2181,h3:2181/chroot'.")
    hosts = _hosts(netloc, bad)
    chroot = DEFAULT_CHROOT
    if slash and path.strip("/"):
        chroot = "/" + unquote(path).strip("/")
        parts = chroot.split("/")[1:]
        if any(p in ("", ".", "..", "zookeeper") or not _NODE_NAME.match(p) for p in parts):
            raise bad(
                f"chroot {chroot!r} is not a valid ZooKeeper path",
                "use names without empty parts, '.', '..', control characters or the reserved "
                "'zookeeper', e.g. '/celery-dlock'.",
            )
    timeout = DEFAULT_TIMEOUT
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == "timeout":
            try:
                timeout = float(value)
            except ValueError:
                timeout = math.nan
            if not math.isfinite(timeout) or timeout <= 0:
                raise bad(
                    f"timeout={value!r} is not a positive number of seconds",
                    "give the session timeout in seconds, e.g. '?timeout=10'.",
                )
        else:
            near = difflib.get_close_matches(name, OPTIONS, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise bad(
                f"unknown option {name!r}",
                f"{hint}the options are: {', '.join(OPTIONS)} (session timeout, seconds).",
            )
    return ZkUrl(tuple(hosts), chroot, timeout, user, password)
