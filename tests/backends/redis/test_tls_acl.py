"""TLS (CA file, client certificate) and ACL users, against real servers behind real TLS.

Three redis-servers, each behind a :class:`tests.support.tls.TlsProxy` that requires a client
certificate; on each, an ACL user made with exactly the rules the docs give
(:func:`celery_dlock.backends.redis.diagnose.acl_rules`). Every misconfiguration gets an error that
names the URL (password hidden) and the fix.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_dlock import LockContended, LockUnavailable, SingletonTask, lock
from celery_dlock.backends.redis.connecting import stale as _stale
from celery_dlock.backends.redis.diagnose import ACL_COMMANDS, acl_rules
from celery_dlock.backends.redis.nodes import Node
from celery_dlock.core.registry import manager_for
from celery_dlock.testing import RedisServer, redis_servers
from tests.ops.test_cli import dlock as dlock_cli
from tests.support.tls import Certificates, TlsProxy, make_certificates, tls_url

pytestmark = pytest.mark.local_redis

ROOT = Path(__file__).resolve().parents[3]
USER = "locker"
PASSWORD = "hunter2-not-for-logs"
DOCS_LINE = f"ACL SETUSER dlock on >PASSWORD -@all {acl_rules('dlock')}"
OPERATOR_LINE = f"ACL SETUSER dlock-admin on >PASSWORD -@all {acl_rules('dlock', operator=True)}"


def set_user(server: RedisServer, user: str, rules: str) -> None:
    """(Re)create ``user`` with ``PASSWORD`` and ``rules``, as the docs' line does."""
    admin = redis.Redis(port=server.port, socket_timeout=5)
    try:
        admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", "-@all",
                              *rules.split())  # fmt: skip
    finally:
        admin.close()


@dataclass
class Site:
    certs: Certificates
    servers: list[RedisServer]
    proxies: list[TlsProxy]

    def url(self, i: int, *, tls: bool = True, user: str | None = USER, **options: Any) -> str:
        auth = f"{user}:{PASSWORD}" if user else ""
        if tls:
            return tls_url(self.proxies[i].port, self.certs, auth=auth, **options)
        at = f"{auth}@" if auth else ""
        return f"redis://{at}127.0.0.1:{self.servers[i].port}/0"


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    certs = make_certificates()
    with redis_servers(3) as servers:
        proxies = [TlsProxy(s.port, certs) for s in servers]
        try:
            for server in servers:  # the operator's line: exercise() lists the keys too
                set_user(server, USER, acl_rules(operator=True))
            yield Site(certs, servers, proxies)
        finally:
            for proxy in proxies:
                proxy.close()


def error_of(urls: list[str], key: str = "report", **options: Any) -> str:
    app = Celery("tls", set_as_current=False)
    app.conf.dlock_urls = urls
    app.conf.dlock_node_timeout = 0.5
    try:
        with lock(app, key, ttl=5, **options):
            pass
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("no error")


# -- it works --------------------------------------------------------------------------------


def exercise(urls: list[str], key: str, ttl: float) -> None:
    """Acquire, renew past several ttls, make a waiter wait and wake it, list, release.

    Each thread's first use of a node costs a TLS handshake (about 80 ms here, half of it
    redis-py loading the system's CA bundle), the renewal thread's included: ``ttl`` leaves
    room for it on a busy machine."""
    manager = manager_for(urls)
    lease = lock(urls, key, ttl=ttl).acquire()
    end = time.monotonic() + 3 * ttl
    while time.monotonic() < end:  # the holding time under test, sampled
        assert not lease.lost, lease.lost_reason
        time.sleep(0.02)
    lease.ensure()
    assert lease.renewals >= 6
    listed = [info.key for info in manager.locks() if info.holder is not None]
    assert listed == [key]
    assert manager.holder(key) is not None

    waiting = threading.Event()
    tokens: list[int] = []

    def waiter() -> None:
        waiting.set()
        with lock(urls, key, ttl=5, wait=10) as other:
            tokens.append(other.token)

    thread = threading.Thread(target=waiter)
    thread.start()
    waiting.wait(5)
    with pytest.raises(LockContended):  # still ours while the waiter waits
        lock(urls, key, ttl=5).acquire()
    released = time.monotonic()
    assert lease.release()
    thread.join(10)
    assert tokens, "the waiter never got the lock"
    assert tokens[0] > lease.token
    assert time.monotonic() - released < 2.0, "the waiter was not woken by the release"
    assert manager.holder(key) is None


@pytest.mark.parametrize(("tls", "user"), [(True, None), (False, USER), (True, USER)],
                         ids=["tls", "acl", "tls+acl"])  # fmt: skip
def test_single_node(site: Site, tls: bool, user: str | None) -> None:
    exercise([site.url(0, tls=tls, user=user)], f"single-{tls}-{user}", ttl=0.5)


def test_redlock_over_three_tls_proxies(site: Site) -> None:
    exercise([site.url(i) for i in range(3)], "redlock-tls", ttl=1.0)


def test_singleton_task_eager_over_tls(site: Site) -> None:
    app = Celery("tls-task", set_as_current=False)
    app.conf.dlock_urls = [site.url(0)]
    app.conf.task_always_eager = True
    seen: list[int] = []

    @app.task(base=SingletonTask, bind=True, lock_key="report:{day}")
    def report(self: Any, day: str) -> str:
        seen.append(self.lease.token)
        return day

    assert report.delay("mon").get() == "mon"
    with lock(app, "report:tue", ttl=5, holder="other-task"):
        dropped = report.apply(("tue",)).get()
        assert dropped["dlock_dropped"] is True
    assert len(seen) == 1


# -- misconfigurations -----------------------------------------------------------------------


def test_tls_misconfigurations_name_the_url_and_the_fix(site: Site) -> None:
    certs = site.certs
    port = site.proxies[0].port
    cases = {
        "wrong CA": (
            site.url(0, ca=certs.other_ca_file),
            "CERTIFICATE_VERIFY_FAILED",
            "is not signed by a CA this client trusts: add ssl_ca_certs=",
        ),
        "no client certificate": (
            site.url(0, client_cert=False),
            "",
            "most likely because it requires a client certificate it trusts: add ssl_certfile=",
        ),
        "client certificate from another CA": (
            site.url(0, certfile=certs.stranger_cert, keyfile=certs.stranger_cert),
            "",
            "requires a client certificate it trusts",
        ),
        "host not in the certificate": (
            site.url(0).replace("@127.0.0.1:", "@localhost:"),
            "Hostname mismatch",
            "does not name the host in the URL",
        ),
        "rediss:// to a plain port": (
            site.url(0).replace(f":{port}/", f":{site.servers[0].port}/"),
            "",
            "no TLS handshake from the server: if this port serves plain Redis, use redis://",
        ),
        "redis:// to the TLS port": (
            f"redis://{USER}:{PASSWORD}@127.0.0.1:{port}/0",
            "",
            "if this port expects TLS, use rediss:// with ssl_ca_certs=",
        ),
    }
    for case, (url, cause, fix) in cases.items():
        got = error_of([url])
        shown = url.replace(PASSWORD, "***")
        assert got.startswith("LockUnavailable: cannot lock 'report': 0 of 1 node(s)"), case
        assert f"({shown}: ConnectionError: " in got or f"({shown}: TimeoutError: " in got, (
            f"{case}: {got}"
        )
        assert cause in got, f"{case}: {got}"
        assert fix in got, f"{case}: {got}"
        assert PASSWORD not in got, case


def test_acl_misconfigurations_say_who_lacks_what_and_how_to_grant_it(
    site: Site, caplog: pytest.LogCaptureFixture
) -> None:
    server = site.servers[0]
    wanted = acl_rules()
    set_user(server, "nowait", wanted.replace(" +blpop", ""))
    set_user(server, "nokeys", wanted.replace("~dlock:*", "~other:*"))
    set_user(server, "noscripts", wanted.replace(" +evalsha", "").replace(" +eval", ""))
    set_user(server, "noscan", wanted.replace(" +scan", ""))
    set_user(server, "nodel", wanted.replace(" +del", ""))
    tls = site.url(0)
    grant = "; grant them with: ACL SETUSER {user} " + wanted

    wrong = error_of([tls.replace(PASSWORD, "wrong-pw")])
    assert "AuthenticationError: wrong password or user name in the URL" in wrong
    assert f"rediss://{USER}:***@127.0.0.1:" in wrong
    assert "wrong-pw" not in wrong

    for user, missing in [
        ("nokeys", "no permissions to access one of the keys"),
        ("noscripts", "no permissions to run the 'evalsha' command"),
    ]:
        got = error_of([tls.replace(f"{USER}:", f"{user}:")])
        assert f"rediss://{user}:***@127.0.0.1:{site.proxies[0].port}/0" in got, got
        assert f"NoPermissionError: ACL user {user!r} may not run" in got or (
            f"ResponseError: ACL user {user!r} may not run" in got
        ), got
        assert missing in got, got
        assert got.endswith(grant.format(user=user) + ")"), got
        assert PASSWORD not in got

    # Without DEL (called inside the release script) the lock is taken, but not released:
    # the warning says why; the key expires by its ttl.
    caplog.set_level(logging.WARNING, "celery_dlock.release")
    nodel = tls.replace(f"{USER}:", "nodel:")
    with lock([nodel], "no-del", ttl=5):
        pass
    warned = [r.getMessage() for r in caplog.records if "no-del" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "failed on rediss://nodel:***@" in warned[0]
    assert "ResponseError: ACL user 'nodel' may not run" in warned[0]
    assert "The user executing the script can't run this command" in warned[0]
    assert grant.format(user="nodel") in warned[0]
    assert PASSWORD not in warned[0]

    # Without BLPOP a user can still try the lock; waiting fails at once, not in a spin.
    nowait = tls.replace(f"{USER}:", "nowait:")
    with lock([nowait], "no-wait", ttl=5):
        started = time.monotonic()
        with pytest.raises(LockUnavailable) as info:
            lock([nowait], "no-wait", ttl=5, wait=5).acquire()
        assert time.monotonic() - started < 1.0
    got = str(info.value)
    assert "cannot wait for 'no-wait': rediss://nowait:***@" in got
    assert "no permissions to run the 'blpop' command" in got
    assert got.endswith(grant.format(user="nowait"))

    noscan = manager_for([tls.replace(f"{USER}:", "noscan:")])
    with pytest.raises(LockUnavailable, match="no permissions to run the 'scan' command") as info:
        noscan.locks()
    assert str(info.value).endswith(f"ACL SETUSER noscan {acl_rules(operator=True)}")


def test_missing_tls_files_are_config_errors(site: Site) -> None:
    from celery_dlock import ConfigError

    url = site.url(0, ca="/nonexistent/ca.pem")
    with pytest.raises(ConfigError) as info:
        lock([url], "k")
    assert "ssl_ca_certs='/nonexistent/ca.pem' is not a file" in str(info.value)
    assert "rediss://locker:***@" in str(info.value)
    assert PASSWORD not in str(info.value)


# -- the operator command --------------------------------------------------------------------


def test_operator_listing_over_tls_as_an_acl_user(site: Site) -> None:
    url = site.url(0)
    with lock([url], "cli-key", ttl=10):
        shown = dlock_cli([url], "list")
        refused = dlock_cli([url.replace(f"{USER}:", "noscan:")], "list")
    assert shown.returncode == 0, shown.stderr
    assert "cli-key" in shown.stdout
    assert f"rediss://{USER}:***@127.0.0.1:{site.proxies[0].port}/0" in shown.stdout
    assert refused.returncode == 1
    assert refused.stderr.startswith("Error: cannot list locks on rediss://noscan:***@127.0.0.1:")
    assert "ACL user 'noscan' may not run" in refused.stderr
    assert "Traceback" not in refused.stderr
    for output in (shown, refused):
        assert PASSWORD not in output.stdout + output.stderr


# -- TLS bytes that poll() cannot see ----------------------------------------------------------


def test_decrypted_bytes_waiting_in_tls_make_an_idle_connection_stale(site: Site) -> None:
    node = Node(site.url(0), 1.0)
    try:
        conn = node.connection()
        conn.connect()
        assert not _stale(conn)
        sock = conn._sock
        sock.sendall(b"TIME\r\n")  # a reply nobody will read through the parser
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        assert poller.poll(2000), "no reply"
        assert sock.recv(1) == b"*"  # one byte of the record; the rest stays decrypted in TLS
        assert sock.pending() > 0
        assert not poller.poll(0), "poll() should not see bytes held in the TLS layer"
        assert _stale(conn)
    finally:
        node.close()


# -- the docs show the rules this file proves ------------------------------------------------


def test_docs_show_the_tested_acl_line() -> None:
    text = (ROOT / "docs" / "topologies.md").read_text()
    assert DOCS_LINE in text
    assert OPERATOR_LINE in text
    assert "+scan" not in DOCS_LINE
    assert all(f"+{command}" in DOCS_LINE for command in ACL_COMMANDS)
