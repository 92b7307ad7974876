"""``zookeeper://`` and ``zookeepers://`` (TLS) URLs: the ensemble, the chroot, digest
credentials, the session timeout and the TLS options.

::

    zookeeper://h1:2181,h2:2181,h3:2181/celery-dlock
    zookeeper://user:secret@h1:2181,h2:2181/celery-dlock?timeout=10
    zookeepers://zk1.internal:2281,zk2.internal:2281/celery-dlock?ssl_ca_certs=/etc/zk-tls/ca.pem
        &ssl_certfile=/etc/zk-tls/client.crt&ssl_keyfile=/etc/zk-tls/client.key

The host list is kazoo's connect string (https://kazoo.readthedocs.io/en/latest/api/client.html);
the path is the chroot under which every lock node lives (default ``/celery-dlock``);
``user:password`` is ZooKeeper digest authentication, and the nodes are then created with an ACL
that only that user may change; ``timeout`` is the session timeout asked of the servers, in
seconds (the servers may grant another within their ``minSessionTimeout``/``maxSessionTimeout``).

TLS is spelled as this library spells it for Redis (``rediss://``, docs/topologies.md): the
scheme ``zookeepers://`` turns it on for every server of the list (their ``secureClientPort``),
and redis-py's ``ssl_*`` query options, with the same names and meanings, configure it; kazoo
does the handshake (``KazooClient(use_ssl=True, ...)``). A scheme rather than ``?ssl=true``
because the first word of the URL, shown in every log line and error, then says whether the
connection is encrypted, and because the ``ssl_*`` options on a plain ``zookeeper://`` URL can be
refused as the mistake they are instead of silently switching TLS on.

======================  ========================================================================
``ssl_ca_certs``        PEM file of the CA(s) that signed the servers' certificates, trusted
                        beside the system's trusted CAs (by kazoo as by redis-py)
``ssl_certfile``        this client's certificate (PEM), for servers that require one
                        (``ssl.clientAuth``, the default of a ZooKeeper ``secureClientPort``)
``ssl_keyfile``         its private key (PEM); without it, the key is read from ``ssl_certfile``
``ssl_password``        the password of an encrypted ``ssl_keyfile`` (never shown: ``***``)
``ssl_cert_reqs``       ``required`` (the default: the servers' certificates must verify),
                        ``optional`` (the same, as for any TLS client in Python) or ``none``
``ssl_check_hostname``  ``true`` (the default unless ``ssl_cert_reqs=none``): each server's
                        certificate must name the host (or IP address) the URL gives for it.
                        kazoo's own default is off; redis-py's, and this library's, is on
======================  ========================================================================

Values are percent-encoded like any URL query value (a ``+`` reads as a space: ``%2B``).

The files are read when the URL is parsed (when the lock is defined), so a missing or unreadable
file, a key that does not match its certificate, an encrypted key without its password or with
a wrong one are a :class:`ConfigError` then, not a connection that never comes up. What the
servers make of the certificates is only known on connecting: a :class:`LockUnavailable` after
the session timeout at most, naming the TLS error and the likely fix (:func:`connect_hint`).
"""

from __future__ import annotations

import difflib
import math
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote

from celery_dlock.core.errors import ConfigError
from celery_dlock.core.urls import (
    PERCENT_ENCODE,
    SERVER_CERTIFICATE_HINTS,
    TLS_FILES,
    misread_userinfo,
    redact,
    tls_file_problem,
)

SCHEME = "zookeeper"
#: The same over TLS (as ``rediss://`` is ``redis://`` over TLS).
TLS_SCHEME = "zookeepers"
SCHEMES = (SCHEME, TLS_SCHEME)
DEFAULT_PORT = 2181
DEFAULT_CHROOT = "/celery-dlock"
#: Session timeout asked for when the URL names none (seconds).
DEFAULT_TIMEOUT = 10.0
OPTIONS = ("timeout",)
#: The TLS options, redis-py's names (see the module docstring); ``zookeepers://`` only.
TLS_OPTIONS = (
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_cert_reqs",
    "ssl_check_hostname",
)
#: ``ssl_cert_reqs`` → kazoo's ``verify_certs``. A TLS client always checks a certificate the
#: server sends, so ``optional`` is ``required`` (Python's ``ssl.CERT_OPTIONAL`` on a client).
CERT_REQS = {"required": True, "optional": True, "none": False}
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")

_HOST = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9_.-]+))(?::(?P<port>\d*))?$")
_NODE_NAME = re.compile(r"^[^\x00-\x1f\x7f]+$")


@dataclass(frozen=True)
class ZkTls:
    """The TLS options of a ``zookeepers://`` URL (names as in the module docstring)."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    password: str | None = field(default=None, repr=False)
    cert_reqs: str = "required"
    check_hostname: bool = True

    @property
    def verify(self) -> bool:
        """Whether the servers' certificates are verified (kazoo's ``verify_certs``)."""
        return CERT_REQS[self.cert_reqs]

    def kazoo_args(self) -> dict[str, Any]:
        """The keyword arguments of ``KazooClient`` that carry these options."""
        return {
            "use_ssl": True,
            "ca": self.ca_certs,
            "certfile": self.certfile,
            # kazoo loads a client certificate only when given both files; Python's
            # load_cert_chain reads the key from the certificate's file when it is named twice.
            "keyfile": self.keyfile or self.certfile,
            # Never None: OpenSSL would then ask for an encrypted key's password on the
            # terminal, from kazoo's connection thread (parse() refuses such a key anyway).
            "keyfile_password": self.password or "",
            "verify_certs": self.verify,
            "check_hostname": self.check_hostname,
        }

    def context(self) -> ssl.SSLContext:
        """An SSL context as kazoo builds one from these options (``create_tcp_connection`` in
        kazoo/handlers/utils.py), for other connections to the same servers, such as the
        four-letter words (``srvr``), which a ``secureClientPort`` answers over TLS only.
        Reads the system's trusted CAs (~0.1 s): not for every call."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
        context.check_hostname = self.check_hostname
        context.verify_mode = ssl.CERT_REQUIRED if self.verify else ssl.CERT_NONE
        if self.ca_certs is not None:
            context.load_verify_locations(self.ca_certs)
        if self.certfile is not None:
            args = self.kazoo_args()
            context.load_cert_chain(self.certfile, args["keyfile"], args["keyfile_password"])
        return context

    def query(self) -> str:
        """The options given, as a URL query, the password as ``***``."""
        pairs = [
            ("ssl_ca_certs", self.ca_certs),
            ("ssl_certfile", self.certfile),
            ("ssl_keyfile", self.keyfile),
            ("ssl_password", "***" if self.password is not None else None),
            ("ssl_cert_reqs", self.cert_reqs if self.cert_reqs != "required" else None),
            (
                "ssl_check_hostname",
                None if self.check_hostname == self.verify else str(self.check_hostname).lower(),
            ),
        ]
        return "&".join(f"{n}={quote(v, safe='/*')}" for n, v in pairs if v is not None)


#: What one shared kazoo client serves (:meth:`ZkUrl.client_key`).
ClientKey = tuple[str, str | None, str | None, float, ZkTls | None]


@dataclass(frozen=True)
class ZkUrl:
    """One parsed ``zookeeper://`` or ``zookeepers://`` URL."""

    hosts: tuple[tuple[str, int], ...]
    chroot: str = DEFAULT_CHROOT
    timeout: float = DEFAULT_TIMEOUT
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    #: The TLS options of a ``zookeepers://`` URL; None for plain ``zookeeper://``.
    tls: ZkTls | None = None

    @property
    def scheme(self) -> str:
        return SCHEME if self.tls is None else TLS_SCHEME

    @property
    def connect_string(self) -> str:
        """``host:port,host:port`` for kazoo (no chroot: paths carry it, see the lock core)."""
        return ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.hosts)

    @property
    def shown(self) -> str:
        """The URL with any password hidden, for logs and errors."""
        who = f"{self.user}:***@" if self.user is not None else ""
        query = self.tls.query() if self.tls is not None else ""
        return f"{self.scheme}://{who}{self.connect_string}{self.chroot}" + (
            f"?{query}" if query else ""
        )

    def client_key(self) -> ClientKey:
        """What one shared client serves: the same servers, credentials, timeout and TLS."""
        return (self.connect_string, self.user, self.password, self.timeout, self.tls)

    def kazoo_args(self) -> dict[str, Any]:
        """The TLS keyword arguments of ``KazooClient`` (none for plain ``zookeeper://``)."""
        return self.tls.kazoo_args() if self.tls is not None else {}


def is_zookeeper(url: object) -> bool:
    """True for a ``zookeeper://`` or ``zookeepers://`` URL (the setting selects this backend
    by its scheme)."""
    return isinstance(url, str) and url.lower().startswith(tuple(f"{s}://" for s in SCHEMES))


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
    shown = redact(url)

    def bad(problem: str, fix: str) -> ConfigError:
        return ConfigError(f"{setting}: {shown!r}: {problem}; {fix}")

    if not is_zookeeper(url):
        raise bad(
            "not a zookeeper:// URL",
            "write it as 'zookeeper://host:2181,host:2181/chroot' (zookeepers:// for TLS).",
        )
    if misread_userinfo(url):
        raise bad(
            "an '@' comes after a '/', '?' or '#', so it is not user:password@hosts",
            f"{PERCENT_ENCODE}.",
        )
    scheme, _, rest = url.partition("://")
    secure = scheme.lower() == TLS_SCHEME
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
    try:
        hosts = _hosts(netloc, bad)
    except ConfigError:
        if user is None and "@" in url.partition("://")[2]:
            # An '@' past the host list: most likely a password with a raw '/', '?' or '#'
            # ended the host list early, and the bad "host" is part of it: do not show it.
            raise bad(
                "the host list is not host:port, and an '@' follows it",
                "percent-encode '/', '?', '#', '@' and ':' in the user name and password "
                "(e.g. '/' as %2F).",
            ) from None
        raise
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
    timeout, options = _query(query, secure, bad)
    tls = _tls(options, bad) if secure else None
    return ZkUrl(tuple(hosts), chroot, timeout, user, password, tls)


def _query(
    query: str, secure: bool, bad: Callable[[str, str], ConfigError]
) -> tuple[float, dict[str, str]]:
    """The session timeout and the other options of the query, each known and given once."""
    timeout = DEFAULT_TIMEOUT
    options: dict[str, str] = {}
    known = OPTIONS + TLS_OPTIONS
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in options:
            raise bad(f"option {name!r} is given twice", "give it once.")
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise bad(
                f"unknown option {name!r}",
                f"{hint}the options are: timeout (session timeout, seconds) and, for "
                f"zookeepers:// (TLS), {', '.join(TLS_OPTIONS)}.",
            )
        if name in TLS_OPTIONS and not secure:
            raise bad(
                f"{name} is a TLS option and this is a plain zookeeper:// URL",
                "write zookeepers:// for TLS to the servers' secureClientPort, or remove it.",
            )
        options[name] = value
    if "timeout" in options:
        value = options["timeout"]
        try:
            timeout = float(value)
        except ValueError:
            timeout = math.nan
        if not math.isfinite(timeout) or timeout <= 0:
            raise bad(
                f"timeout={value!r} is not a positive number of seconds",
                "give the session timeout in seconds, e.g. '?timeout=10'.",
            )
    return timeout, options


def _tls(options: dict[str, str], bad: Callable[[str, str], ConfigError]) -> ZkTls:
    """The TLS options, checked, their files read (see the module docstring)."""
    cert_reqs = options.get("ssl_cert_reqs", "required").lower()
    if cert_reqs not in CERT_REQS:
        raise bad(
            f"ssl_cert_reqs={options['ssl_cert_reqs']!r} is not one of {', '.join(CERT_REQS)}",
            "use 'required' (the default: the servers' certificates must verify).",
        )
    verify = CERT_REQS[cert_reqs]
    check_hostname = verify
    if "ssl_check_hostname" in options:
        value = options["ssl_check_hostname"]
        if value.lower() not in _TRUE + _FALSE:
            raise bad(
                f"ssl_check_hostname={value!r} is not true or false",
                "write ssl_check_hostname=true (the default) or ssl_check_hostname=false.",
            )
        check_hostname = value.lower() in _TRUE
        if check_hostname and not verify:
            raise bad(
                "ssl_check_hostname=true needs the certificate verified, and "
                "ssl_cert_reqs=none turns that off",
                "drop ssl_cert_reqs=none (verify the servers' certificates), or "
                "ssl_check_hostname.",
            )
    files: dict[str, str] = {}
    for name in TLS_FILES:
        path = options.get(name)
        if path is None:
            continue
        problem = tls_file_problem(name, path, "servers' certificates")
        if problem is not None:
            raise bad(*problem)
        files[name] = path
    password = options.get("ssl_password")
    if "ssl_keyfile" in files and "ssl_certfile" not in files:
        raise bad(
            "ssl_keyfile without ssl_certfile",
            "add ssl_certfile=/path/to/client.crt (the certificate of that key).",
        )
    if password is not None and "ssl_certfile" not in files:
        raise bad(
            "ssl_password without a client key to unlock",
            "add ssl_certfile=... and ssl_keyfile=..., or remove ssl_password.",
        )
    tls = ZkTls(
        ca_certs=files.get("ssl_ca_certs"),
        certfile=files.get("ssl_certfile"),
        keyfile=files.get("ssl_keyfile"),
        password=password,
        cert_reqs=cert_reqs,
        check_hostname=check_hostname,
    )
    _load(tls, bad)
    return tls


def _load(tls: ZkTls, bad: Callable[[str, str], ConfigError]) -> None:
    """Load the files as kazoo will (``ssl.SSLContext``), so that what is wrong with them is a
    :class:`ConfigError` now rather than a handshake that fails on every retry later."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if tls.ca_certs is not None:
        try:
            context.load_verify_locations(tls.ca_certs)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise bad(
                f"ssl_ca_certs={tls.ca_certs!r} holds no PEM CA certificate ({exc})",
                "give the CA certificate(s) in PEM ('-----BEGIN CERTIFICATE-----').",
            ) from None
    if tls.certfile is None:
        return
    keyfile = tls.keyfile or tls.certfile
    if tls.keyfile is None and not _holds_key(tls.certfile):
        raise bad(
            f"ssl_certfile={tls.certfile!r} holds no private key and no ssl_keyfile is given",
            "add ssl_keyfile=/path/to/client.key (the key of that certificate).",
        )
    asked = False

    def password() -> str:
        # Called by OpenSSL only for an encrypted key; never None (it would prompt on a tty).
        nonlocal asked
        asked = True
        return tls.password or ""

    try:
        context.load_cert_chain(tls.certfile, keyfile, password=password)
    except (ssl.SSLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or type(exc).__name__
        key = "ssl_keyfile" if tls.keyfile is not None else "ssl_certfile"
        if asked and tls.password is None:
            raise bad(
                f"{key}={keyfile!r} is an encrypted key and no ssl_password is given",
                "add ssl_password=... (percent-encoded), or give the key unencrypted.",
            ) from None
        if asked:
            raise bad(
                f"ssl_password does not decrypt {key}={keyfile!r} ({reason})",
                "give the key's password (percent-encoded in the URL).",
            ) from None
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise bad(
                f"{key}={keyfile!r} is not the key of ssl_certfile={tls.certfile!r}",
                "give the certificate and the key that belong together.",
            ) from None
        raise bad(
            f"ssl_certfile={tls.certfile!r} / {key}={keyfile!r} are not a PEM certificate "
            f"and its key ({reason})",
            "give this client's certificate and private key in PEM.",
        ) from None


def _holds_key(path: str) -> bool:
    try:
        with open(path, "rb") as pem:
            return b"PRIVATE KEY-----" in pem.read()
    except OSError:
        return True  # let load_cert_chain say what is wrong


#: Hints for a connection that did not come up, by a fragment of kazoo's last error. Order
#: matters: a hostname mismatch is also a CERTIFICATE_VERIFY_FAILED.
_TLS_HINTS = (
    *SERVER_CERTIFICATE_HINTS,
    (
        ("ALERT_BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "ALERT_UNKNOWN_CA",
         "ALERT_CERTIFICATE_UNKNOWN", "HANDSHAKE_FAILURE"),
        "the server refused this client's certificate, or its lack of one: servers with "
        "ssl.clientAuth require a client certificate signed by a CA in their ssl.trustStore: "
        "add ssl_certfile=/path/to/client.crt and ssl_keyfile=/path/to/client.key to the URL",
    ),
    (
        ("WRONG_VERSION_NUMBER", "wrong version number", "record layer failure"),
        "no TLS from the server: if this port serves plain ZooKeeper (its clientPort), use "
        "zookeeper://, or the server's secureClientPort",
    ),
    (
        ("UNEXPECTED_EOF", "EOF occurred in violation of protocol"),
        "the server closed the connection during the TLS handshake: if this port serves plain "
        "ZooKeeper (its clientPort), use zookeeper://, or the server's secureClientPort; if it "
        "is the secureClientPort, the server may not trust this client's certificate "
        "(ssl_certfile, ssl_keyfile)",
    ),
)  # fmt: skip
_PLAIN_HINTS = (
    (
        ("socket connection broken", "Connection reset"),
        "the server closed the connection at once: if this port expects TLS (the server's "
        "secureClientPort), use zookeepers:// with ssl_ca_certs=... (and a client certificate "
        "if it asks for one)",
    ),
)


def connect_hint(url: ZkUrl, error: str) -> str | None:
    """The likely fix for a connection that failed with ``error`` (kazoo's text), if known."""
    hints = _TLS_HINTS if url.tls is not None else _PLAIN_HINTS
    return next((hint for marks, hint in hints if any(m in error for m in marks)), None)
