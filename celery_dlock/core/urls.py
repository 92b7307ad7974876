"""Lock store URLs: which backend serves a URL (the scheme table, each backend module imported
by name when first needed), the check of a URL list (the backend's own, after a misspelt scheme
is named), passwords hidden for messages, and the TLS options' checks and warnings.

Below :mod:`celery_dlock.core.config`, whose ``Settings`` check their URLs here; the registry
(:mod:`celery_dlock.core.registry`) makes a backend from the module :func:`backend_module` names.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote_plus

from celery_dlock.core.errors import ConfigError

#: Query options whose values are secrets (shown as ``***``); "pas": misspelt passwords too.
_SECRET_MARKERS = ("pas", "pwd", "secret", "token")


def redact(url: Any) -> str:
    """The URL with every password (user info, ``*password*`` query options) as ``***``.

    Read from the raw text, not through ``urlsplit``, so that a password holding a raw ``/``,
    ``?``, ``#``, ``@`` or ``:`` (which URL parsers split elsewhere) is hidden too: everything
    after the user name's ``:`` up to the *last* ``@`` goes, and a secret query option's value
    runs to the next ``&name=`` (a ``#`` does not end it). Errs towards hiding: an ``@`` in a
    query value hides what stands before it.
    """
    if not isinstance(url, str):
        return "<not a URL>"
    hidden = [False] * len(url)
    start = url.find("://")
    start = 0 if start < 0 else start + 3
    at = url.rfind("@", start)
    if at >= 0:
        colon = url.find(":", start, at)
        if colon >= 0:
            for i in range(colon + 1, at):
                hidden[i] = True
    for match in _OPTION.finditer(url, start):
        if secret_option(unquote_plus(match.group(1))):  # parsers decode names too
            end = _NEXT_OPTION.search(url, match.end())
            for i in range(match.end(), end.start() if end else len(url)):
                hidden[i] = True
    if not any(hidden):
        return url
    out: list[str] = []
    for i, char in enumerate(url):
        if not hidden[i]:
            out.append(char)
        elif i == 0 or not hidden[i - 1]:
            out.append("***")
    return "".join(out)


#: A query option's name (percent-encoded or not), as it opens the option; and the start of
#: the next one.
_OPTION = re.compile(r"[?&]([^&=#?]+)=")
_NEXT_OPTION = re.compile(r"&[A-Za-z_][A-Za-z0-9_.-]*=")


#: What a URL with a password that URL parsers cannot read is told (see :func:`misread_userinfo`).
PERCENT_ENCODE = (
    "percent-encode '/', '?', '#' and '@' in the user name and password ('/' as %2F, '?' as "
    "%3F, '#' as %23, '@' as %40; urllib.parse.quote(password, safe='') does it)"
)


def misread_userinfo(url: str) -> bool:
    """Whether URL parsers would end ``url``'s user info early: an ``@`` stands in what they
    read as the path or fragment (or a query piece that is no ``name=value``), which means a
    raw ``/``, ``#`` or ``?`` in the password. Such a URL cannot authenticate, and the pieces
    a parser makes of it (host, path, database) hold parts of the password."""
    rest = url.partition("://")[2] if "://" in url else url
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    if "@" not in tail:
        return False
    if url.lower().startswith("unix:"):
        # unix://[user:password@]/path: the path may hold an '@'; user info ends with one.
        return bool(netloc) and not netloc.endswith("@")
    before_fragment, _, fragment = tail.partition("#")
    path, _, query = before_fragment.partition("?")
    piece = query.partition("@")[0].rpartition("&")[2]  # the option an '@' stands in
    return "@" in path or "@" in fragment or ("@" in query and "=" not in piece)


def secret_option(option: str) -> bool:
    """Whether a URL query option holds a secret (a password, token, ...)."""
    return any(marker in option.lower() for marker in _SECRET_MARKERS)


#: The values ``ssl_cert_reqs`` takes (redis-py's and kazoo's reading of them).
CERT_REQS = ("required", "optional", "none")
_FALSE = ("0", "f", "false", "n", "no", "off")


#: Hints for a TLS connection that failed on the server's certificate, by a fragment of the
#: error text; every TLS backend's list starts with these (a hostname mismatch is also a
#: CERTIFICATE_VERIFY_FAILED, so it comes first).
SERVER_CERTIFICATE_HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("Hostname mismatch", "IP address mismatch"),
        "the server's certificate does not name the host in the URL: connect by a name (or "
        "IP address) its certificate lists",
    ),
    (
        ("CERTIFICATE_VERIFY_FAILED",),
        "the server's certificate is not signed by a CA this client trusts: add "
        "ssl_ca_certs=/path/to/ca.pem (the CA that signed it) to the URL",
    ),
)


#: The TLS query options that name PEM files (redis-py's names, on ``rediss://`` and
#: ``zookeepers://`` URLs alike) and what each file holds, for the errors.
TLS_FILES = {
    "ssl_ca_certs": "the CA certificate(s) that signed the {certificates}",
    "ssl_certfile": "this client's certificate",
    "ssl_keyfile": "this client's private key",
}


def tls_file_problem(
    name: str, path: str, certificates: str = "server's certificate"
) -> tuple[str, str] | None:
    """What is wrong with TLS file option ``name`` (a key of :data:`TLS_FILES`) set to
    ``path``, and the fix, for a backend's URL error; None when this process can read the file.
    ``certificates``: whose certificates a CA file signs (``"servers' certificates"`` for an
    ensemble)."""
    what = TLS_FILES[name].format(certificates=certificates)
    if not path:
        return f"{name} is empty", f"give the path of a PEM file ({what})."
    if not os.path.isfile(path):
        return (
            f"{name}={path!r} is not a file",
            f"give the path of a PEM file ({what}) that this process can read.",
        )
    if not os.access(path, os.R_OK):
        return (
            f"{name}={path!r} cannot be read by this process",
            f"let this process's user read it ({what}).",
        )
    return None


def tls_warnings(urls: Sequence[str]) -> list[str]:
    """One line per TLS URL whose options turn verification off (``ssl_cert_reqs=none``,
    ``ssl_check_hostname=false``): such a connection is encrypted but not authenticated, so
    whoever sits on the path can pose as the server, read the password and every lock."""
    found: list[str] = []
    for url in urls:
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if not (scheme.startswith("rediss") or scheme == "zookeepers"):
            continue
        query = url.partition("?")[2].partition("#")[0]
        options = {  # decoded as redis-py decodes them: ssl%5Fcert%5Freqs=%6Eone is off too
            unquote_plus(name).lower(): unquote_plus(value)
            for name, _, value in (p.partition("=") for p in query.split("&"))
        }
        off = []
        if options.get("ssl_cert_reqs", "").lower() == "none":
            off.append("ssl_cert_reqs=none: the server's certificate and host name are not checked")
        elif options.get("ssl_check_hostname", "").lower() in _FALSE:
            off.append("ssl_check_hostname=false: the server's host name is not checked")
        if off:
            found.append(
                f"{redact(url)}: TLS verification is off ({'; '.join(off)}), so anyone on the "
                "network path can pose as the server and read the password and the locks; "
                "give ssl_ca_certs=/path/to/ca.pem and drop the option"
            )
    return found


#: URL scheme (the part before any ``+``) → the module of the lock store that serves it. Imported
#: by name when first needed, as Celery picks a result backend and kombu a transport, so that
#: the settings, the lease core and the Celery layer import no backend. A backend module offers
#: ``check_urls(urls, setting)`` (the URLs, checked) and ``make_backend(settings)`` (a
#: :class:`celery_dlock.core.backend.Backend`). A scheme not listed goes to the Redis backend, whose
#: check names every scheme there is.
BACKENDS: dict[str, str] = {
    "redis": "celery_dlock.backends.redis",
    "rediss": "celery_dlock.backends.redis",
    "unix": "celery_dlock.backends.redis",
    "zookeeper": "celery_dlock.backends.zookeeper",
    "zookeepers": "celery_dlock.backends.zookeeper",  # TLS
    "memory": "celery_dlock.backends.memory",  # in-process, for tests
}
DEFAULT_BACKEND = "celery_dlock.backends.redis"
#: The pip extra that brings a backend's client library (``pip install celery-dlock[...]``).
EXTRAS: dict[str, str] = {"celery_dlock.backends.zookeeper": "zookeeper"}


def backend_module(urls: Sequence[Any], setting: str = "dlock_urls") -> Any:
    """The backend module that serves ``urls`` (all of them: one list, one kind of store)."""
    for url in urls:
        _check_scheme(url, setting)
    names = {BACKENDS.get(_scheme(url), DEFAULT_BACKEND) for url in urls}
    if len(names) > 1:
        shown = ", ".join(repr(redact(url)) for url in urls if isinstance(url, str))
        raise ConfigError(
            f"{setting} mixes kinds of lock store ({shown}): every URL of one list must name "
            "the same kind; keep the URLs of one of them."
        )
    name = names.pop() if names else DEFAULT_BACKEND
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]  # the distribution's top-level package
        if not missing or missing == name or name.startswith(f"{missing}."):
            raise  # this library itself is broken, not a dependency missing
        shown = ", ".join(repr(redact(url)) for url in urls if isinstance(url, str))
        extra = EXTRAS.get(name)
        fix = f"pip install 'celery-dlock[{extra}]'" if extra else f"pip install {missing}"
        raise ConfigError(
            f"{setting} ({shown}) needs the Python package {missing!r}, which is not "
            f"installed; install it: {fix}."
        ) from exc


def _check_scheme(url: Any, setting: str) -> None:
    """Refuse a misspelt scheme of a backend other than Redis (whose own check names every
    Redis scheme), e.g. ``zookeper://``, naming the one meant."""
    scheme = _scheme(url)
    if not scheme or scheme in BACKENDS:
        return
    others = [s for s, module in BACKENDS.items() if module != DEFAULT_BACKEND]
    close = difflib.get_close_matches(scheme, others, n=1, cutoff=0.75)
    if close:
        raise ConfigError(
            f"{setting}: {redact(url)!r} has scheme {scheme!r}; did you mean {close[0]!r}? "
            f"Write it as '{close[0]}://...'."
        )


def _scheme(url: Any) -> str:
    if not isinstance(url, str) or "://" not in url:
        return ""
    return url.split("://", 1)[0].split("+", 1)[0].lower()


def check_urls(urls: Any, setting: str = "dlock_urls") -> tuple[str, ...]:
    """Validate a URL list: a non-empty list, then what the backend its scheme names checks."""
    if isinstance(urls, str):
        urls = [urls]
    if not isinstance(urls, Sequence) or isinstance(urls, bytes):
        raise ConfigError(
            f"{setting} must be a list of lock-store URLs, not {type(urls).__name__} ({urls!r})."
        )
    if not urls:
        raise ConfigError(
            f"{setting} is empty: give one URL (redis://host:6379/0, or one zookeeper:// URL "
            "listing the ensemble), or three or more independent Redis masters for Redlock."
        )
    checked: tuple[str, ...] = backend_module(urls, setting).check_urls(tuple(urls), setting)
    return checked
