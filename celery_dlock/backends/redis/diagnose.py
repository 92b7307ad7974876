"""What a node's failure means, in words that name the fix: passwords, ACL permissions, TLS.

Also the one statement of what an ACL user needs (:data:`ACL_COMMANDS`, :func:`acl_rules`),
shared by the error messages, the docs and the test that proves it is enough.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from redis.exceptions import MovedError, NoPermissionError
from redis.sentinel import MasterNotFoundError

from celery_dlock.core.urls import SERVER_CERTIFICATE_HINTS

if TYPE_CHECKING:
    from celery_dlock.backends.redis.nodes import Node

#: Every command a worker (or any process that takes locks) runs: the scripts by SHA (and by
#: source after a ``SCRIPT FLUSH``), the blocking wait, each command the Lua scripts in
#: :mod:`celery_dlock.backends.redis.scripts` call (Redis checks those against the user's ACL too),
#: and ``INFO`` (its ``run_id``: two Redlock URLs that reach one server are refused; a user denied
#: it is not checked).
ACL_COMMANDS = (
    "evalsha",
    "eval",
    "blpop",
    "get",
    "strlen",
    "getrange",
    "set",
    "del",
    "exists",
    "pttl",
    "pexpire",
    "rpush",
    "time",
    "info",
)

#: What an operator's user needs on top: ``celery dlock list`` and ``purge`` (and the compat
#: layers' ``clear_locks``) find the keys with SCAN. Redis does not check SCAN against the
#: user's key patterns: it lists every key name of the database, so workers do without it.
OPERATOR_ACL_COMMANDS = ("scan",)

#: What a Redis Cluster user needs on top: redis-py's ``RedisCluster`` reads the slot map
#: (``CLUSTER SLOTS``) and the command table (``COMMAND``) when it starts.
CLUSTER_ACL_COMMANDS = ("cluster|slots", "command")


def acl_rules(prefix: str = "dlock", *, cluster: bool = False, operator: bool = False) -> str:
    """The ACL rules that let a user take locks under ``prefix`` (the ``dlock_prefix``), on a
    Redis Cluster with ``cluster=True``; with ``operator=True`` also list and purge them (the
    operator command), which needs SCAN, and SCAN sees every key name of the database."""
    commands = (
        ACL_COMMANDS
        + (OPERATOR_ACL_COMMANDS if operator else ())
        + (CLUSTER_ACL_COMMANDS if cluster else ())
    )
    return " ".join([f"~{prefix}:*", *(f"+{command}" for command in commands)])


def refusal(exc: BaseException) -> BaseException | None:
    """The ACL refusal behind ``exc``, if any: redis-py's ``RedisCluster`` turns a refused
    ``CLUSTER SLOTS`` into "Cluster mode is not enabled on this node", keeping the refusal
    only in the exception chain."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return None
        if isinstance(seen, NoPermissionError) or "NOPERM" in str(seen):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


#: Hints for TLS failures, by a fragment of the error text. An ``rediss://`` node:
_TLS_HINTS = (
    (
        ("PEM lib", "NO_START_LINE", "KEY_VALUES_MISMATCH"),
        "ssl_ca_certs, ssl_certfile or ssl_keyfile is not a PEM certificate or key, or the key "
        "does not belong to the certificate",
    ),
    *SERVER_CERTIFICATE_HINTS,
    (
        ("EOF occurred in violation of protocol", "CERTIFICATE_REQUIRED", "UNKNOWN_CA",
         "BAD_CERTIFICATE", "HANDSHAKE_FAILURE", "Connection reset by peer",
         "Connection closed by server"),
        "the TLS server dropped the connection after the handshake, most likely because it "
        "requires a client certificate it trusts: add ssl_certfile=/path/to/client.crt and "
        "ssl_keyfile=/path/to/client.key (signed by a CA the server trusts) to the URL",
    ),
    (
        ("WRONG_VERSION_NUMBER", "wrong version number", "record layer failure",
         "Timeout connecting"),
        "no TLS handshake from the server: if this port serves plain Redis, use redis:// "
        "(or the server's TLS port)",
    ),
)  # fmt: skip
#: ... and a plain ``redis://`` node:
_PLAIN_HINTS = (
    (
        ("Connection reset by peer", "Connection closed by server"),
        "the server closed the connection at once: if this port expects TLS, use rediss:// "
        "with ssl_ca_certs=... (and a client certificate if it asks for one)",
    ),
)


def describe(exc: BaseException, node: Node | None = None) -> str:
    """One node's failure as ``ExceptionType: what it means`` (never a password)."""
    exc = refusal(exc) or exc
    text = str(exc)
    if "HELLO must be called" in text or "NOAUTH" in text:
        text = (
            "the server requires a password; put it in the URL "
            "(redis://:PASSWORD@host:port/db, or redis://USER:PASSWORD@... for an ACL user)"
        )
    elif "invalid username-password pair" in text or "WRONGPASS" in text:
        text = "wrong password or user name in the URL (or the ACL user is disabled)"
    elif isinstance(exc, NoPermissionError) or "user executing the script can't" in text:
        text = _permission(text, node)
    elif isinstance(exc, MovedError):
        text += " (a Redis Cluster node; a plain redis:// URL for it must be redis+cluster://)"
    elif isinstance(exc, MasterNotFoundError):
        # redis-py appends every sentinel client's repr; the service name is what matters.
        service = text.split("'")[1] if text.count("'") >= 2 else "?"
        text = (
            f"no sentinel named a master for {service!r}: the sentinels are unreachable, or "
            "none monitors a service of that name (see SENTINEL MASTERS)"
        )
    elif node is not None:
        hints = _TLS_HINTS if node.endpoint.tls else _PLAIN_HINTS
        hint = next((h for marks, h in hints if any(m in text for m in marks)), None)
        if hint is not None:
            text = f"{text.rstrip('.')}; {hint}"
    return f"{type(exc).__name__}: {text}"


def _permission(text: str, node: Node | None) -> str:
    user = "default"
    prefix = "dlock"
    cluster = False
    if node is not None:
        user = node.endpoint.options.get("username") or "default"
        prefix = node.prefix
        cluster = node.endpoint.kind == "cluster"
    operator = "'scan'" in text  # only listing and purging scan: the operator's line
    rules = acl_rules(prefix, cluster=cluster, operator=operator)
    return (
        f"ACL user {user!r} may not run a command or use a key that celery_dlock needs "
        f"({text}); grant them with: ACL SETUSER {user} {rules}"
    )
