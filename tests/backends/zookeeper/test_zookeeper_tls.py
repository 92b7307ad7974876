"""``zookeepers://``: the ZooKeeper backend over TLS, against a real ZooKeeper TLS endpoint.

The server is Debian's ZooKeeper (tests/support/zookeeper.py) with its Netty connection factory
and a ``secureClientPort`` that requires a client certificate (``ssl.clientAuth=need``, ZooKeeper's
default), its keys in PEM files made per run with ``trustme`` (the server's certificate names
``localhost`` only, so a connection to 127.0.0.1 exercises the hostname check). kazoo does a
real TLS handshake with it; the plain ``clientPort`` is only polled for readiness (``srvr``).
Skipped with one line when ZooKeeper, java or the netty jars of ``libnetty-java`` are missing.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from celery_dlock import lock
from celery_dlock.backends.zookeeper import ZooKeeperBackend, close_all, parse
from celery_dlock.backends.zookeeper.session import shared
from celery_dlock.backends.zookeeper.url import ZkTls
from celery_dlock.core.errors import ConfigError, LockUnavailable
from celery_dlock.core.urls import backend_module
from tests.support.zookeeper import (
    JAR,
    JAVA_OPTS,
    MAIN,
    ZkServer,
    _die_with_parent,
    free_ports,
    skip_reason,
)

#: What ZooKeeper's Netty connection factory needs beside the jars zookeeper.jar's manifest
#: names (Debian's libnetty-java).
NETTY_JARS = [
    Path(f"/usr/share/java/netty-{name}.jar") for name in ("codec", "resolver", "handler")
]


def _reason() -> str | None:
    reason = skip_reason()
    if reason is None:
        missing = [str(jar) for jar in NETTY_JARS if not jar.exists()]
        if missing:
            reason = f"ZooKeeper TLS needs {', '.join(missing)}: apt-get install libnetty-java"
    return reason


REASON = _reason()
needs_zk = pytest.mark.skipif(REASON is not None, reason=REASON or "")

#: The password of the encrypted client key: URL-special characters, to test the encoding too.
KEY_PASSWORD = "k3y p@ss/wörd&x=1"
#: The digest password of the ZooKeeper user.
DIGEST_PASSWORD = "dig3st-s3cret"
#: Session (and connect) timeout of the URLs whose connection is meant to fail: the bound.
FAIL_TIMEOUT = 1.5


@dataclass(frozen=True)
class Pems:
    """PEM files for one run: a CA, the server's key and certificate (``localhost`` only, PKCS#8
    as ZooKeeper's PEM key store reads it), client certificates, and an unrelated CA."""

    directory: Path

    def __getattr__(self, name: str) -> str:
        if name.startswith("_"):  # copy, pickle and pytest probe dunders: not files
            raise AttributeError(name)
        return str(self.directory / f"{name}.pem")


def _pkcs8(cert: trustme.LeafCert, password: bytes | None = None) -> bytes:
    key = serialization.load_pem_private_key(cert.private_key_pem.bytes(), None)
    encryption = (
        serialization.BestAvailableEncryption(password)
        if password
        else serialization.NoEncryption()
    )
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )


def make_pems(directory: Path) -> Pems:
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    other.cert_pem.write_to_path(str(directory / "other_ca.pem"))
    server = ca.issue_cert("localhost")
    (directory / "server.pem").write_bytes(
        _pkcs8(server) + b"".join(c.bytes() for c in server.cert_chain_pems)
    )
    client = ca.issue_cert("dlock-client@example.test")
    client.cert_chain_pems[0].write_to_path(str(directory / "client_cert.pem"))
    client.private_key_pem.write_to_path(str(directory / "client_key.pem"))
    (directory / "client_key_encrypted.pem").write_bytes(_pkcs8(client, KEY_PASSWORD.encode()))
    client.private_key_and_cert_chain_pem.write_to_path(str(directory / "client_both.pem"))
    stranger = other.issue_cert("stranger@example.test")
    stranger.private_key_and_cert_chain_pem.write_to_path(str(directory / "stranger.pem"))
    # Another key of this CA: not the key of client_cert.pem.
    ca.issue_cert("x@example.test").private_key_pem.write_to_path(str(directory / "wrong_key.pem"))
    (directory / "not_pem.pem").write_text("not a certificate\n")
    return Pems(directory)


class TlsZkServer(ZkServer):
    """A standalone server with a TLS ``secureClientPort`` beside its plain ``clientPort``."""

    def __init__(self, root: Path, pems: Pems) -> None:
        plain, self.secure_port = free_ports(2)
        super().__init__(root, plain)
        with self.cfg.open("a") as cfg:
            cfg.write(
                f"secureClientPort={self.secure_port}\n"
                "secureClientPortAddress=127.0.0.1\n"
                "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory\n"
                f"ssl.keyStore.location={pems.server}\n"
                "ssl.keyStore.type=PEM\n"
                f"ssl.trustStore.location={pems.ca}\n"
                "ssl.trustStore.type=PEM\n"
            )

    def start(self) -> None:
        """As :meth:`ZkServer.start`, with the netty jars on the class path."""
        if self.running:
            return
        classpath = ":".join(str(jar) for jar in [JAR, *NETTY_JARS])
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                ["java", *JAVA_OPTS, "-cp", classpath, MAIN, str(self.cfg)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 (one prctl call, no locks)
            )


@pytest.fixture(scope="module")
def pems() -> Iterator[Pems]:
    with tempfile.TemporaryDirectory(prefix="dlock-zk-tls-") as directory:
        yield make_pems(Path(directory))


@pytest.fixture(scope="module")
def server(pems: Pems) -> Iterator[TlsZkServer]:
    if REASON is not None:
        pytest.skip(REASON)
    with tempfile.TemporaryDirectory(prefix="dlock-zk-tls-srv-") as root:
        zk = TlsZkServer(Path(root), pems)
        try:
            zk.start()
            zk.wait_serving()
            yield zk
        finally:
            zk.stop(kill=True)


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Every shared client of this process closed after each test (its session ends)."""
    yield
    close_all()


def tls_url(
    server: TlsZkServer,
    pems: Pems,
    *,
    host: str = "localhost",
    auth: str = "",
    client_cert: bool = True,
    timeout: float = 5.0,
    **options: str,
) -> str:
    """A ``zookeepers://`` URL for the server's TLS port, in a chroot of its own."""
    query = {"timeout": str(timeout), "ssl_ca_certs": pems.ca}
    if client_cert:
        query |= {"ssl_certfile": pems.client_cert, "ssl_keyfile": pems.client_key}
    query |= options
    query = {k: v for k, v in query.items() if v}
    who = f"{auth}@" if auth else ""
    chroot = f"t-{uuid.uuid4().hex[:8]}"
    return f"zookeepers://{who}{host}:{server.secure_port}/{chroot}?{urlencode(query)}"


def refused(url: str) -> tuple[str, float]:
    """Try to take a lock on ``url``, which must fail: the error's text and the time it took."""
    started = time.monotonic()
    with pytest.raises(LockUnavailable) as caught:
        ZooKeeperBackend(url).acquire("k")
    return str(caught.value), time.monotonic() - started


# -- over TLS -----------------------------------------------------------------------------------


@needs_zk
def test_a_lock_is_taken_and_released_over_tls_with_a_client_certificate(
    server: TlsZkServer, pems: Pems
) -> None:
    url = tls_url(server, pems, auth=f"locker:{DIGEST_PASSWORD}")
    backend = ZooKeeperBackend(url)
    other = ZooKeeperBackend(url.replace("timeout=5.0", "timeout=6.0"))  # a second session
    assert shared(backend.url) is not shared(other.url)
    with lock([url], "tls-key", wait=5, holder="task-tls") as lease:
        assert shared(backend.url).client.use_ssl is True
        (holder,) = other.queue("tls-key")  # read back over another TLS session
        assert holder.task_id == "task-tls"
        assert lease.token > 0
    assert other.queue("tls-key") == []
    # The secure port speaks only TLS: the same client, unencrypted, gets no session there.
    plain = url.replace("zookeepers://", "zookeeper://").split("?")[0] + f"?timeout={FAIL_TIMEOUT}"
    text, took = refused(plain)
    assert "if this port expects TLS" in text
    assert "use zookeepers://" in text
    assert took < FAIL_TIMEOUT + 3


@needs_zk
def test_an_encrypted_client_key_is_unlocked_by_ssl_password_which_is_never_shown(
    server: TlsZkServer, pems: Pems, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = tls_url(
        server,
        pems,
        auth=f"locker:{DIGEST_PASSWORD}",
        ssl_keyfile=pems.client_key_encrypted,
        ssl_password=KEY_PASSWORD,
    )
    backend = ZooKeeperBackend(url)
    assert backend.url.tls is not None
    assert backend.url.tls.password == KEY_PASSWORD
    with backend.acquire("enc-key", holder="task-enc") as lease:
        assert lease.token > 0
    # A wrong CA on the same key: the connection fails; its error and the logs hide both.
    failing = tls_url(
        server,
        pems,
        auth=f"locker:{DIGEST_PASSWORD}",
        timeout=FAIL_TIMEOUT,
        ssl_ca_certs=pems.other_ca,
        ssl_keyfile=pems.client_key_encrypted,
        ssl_password=KEY_PASSWORD,
    )
    text, _ = refused(failing)
    # A wrong key password: a ConfigError that names the option, not the password.
    with pytest.raises(ConfigError) as wrong:
        parse(failing.replace(urlencode({"p": KEY_PASSWORD})[2:], "not-" + DIGEST_PASSWORD))
    shown = [
        backend.url.shown,
        repr(backend.url),
        repr(backend),
        *backend.endpoints(),
        text,
        str(wrong.value),
        caplog.text,
    ]
    encoded = (quote(KEY_PASSWORD, safe=""), urlencode({"p": KEY_PASSWORD})[2:])
    for secret in (KEY_PASSWORD, *encoded, DIGEST_PASSWORD):
        assert not [s for s in shown if secret in s], secret
    assert "ssl_password=***" in backend.url.shown
    assert "does not decrypt" in str(wrong.value)


@needs_zk
def test_the_tls_context_of_a_url_is_the_one_kazoo_makes_and_reads_four_letter_words(
    server: TlsZkServer, pems: Pems
) -> None:
    """``ZkTls.context()``: for the ``srvr`` health check, which the secure port answers only
    over TLS (a plain ``srvr`` sent there gets no answer)."""
    tls = parse(
        tls_url(server, pems, ssl_keyfile=pems.client_key_encrypted, ssl_password=KEY_PASSWORD)
    ).tls
    assert tls is not None
    with (
        socket.create_connection(("localhost", server.secure_port), timeout=5) as raw,
        tls.context().wrap_socket(raw, server_hostname="localhost") as sock,
    ):
        sock.sendall(b"srvr")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert b"Mode: standalone" in answer


# -- refusals: a LockUnavailable naming the cause and the fix, within the connect timeout -----


@needs_zk
def test_a_server_certificate_from_another_ca_is_refused_with_the_fix(
    server: TlsZkServer, pems: Pems
) -> None:
    text, took = refused(tls_url(server, pems, timeout=FAIL_TIMEOUT, ssl_ca_certs=pems.other_ca))
    assert "CERTIFICATE_VERIFY_FAILED" in text
    assert "add ssl_ca_certs=/path/to/ca.pem" in text
    assert "zookeepers://localhost:" in text  # names the URL
    assert took < FAIL_TIMEOUT + 3  # bounded by the timeout, not a hang
    # Verification off: the same CA mismatch no longer matters (what ssl_cert_reqs=none means).
    url = tls_url(server, pems, ssl_ca_certs=pems.other_ca, ssl_cert_reqs="none")
    with ZooKeeperBackend(url).acquire("unverified") as lease:
        assert lease.token > 0


@pytest.mark.parametrize("certificate", ["none", "stranger"])
@needs_zk
def test_a_server_that_requires_a_client_certificate_refuses_none_or_a_stranger(
    server: TlsZkServer, pems: Pems, certificate: str
) -> None:
    if certificate == "none":
        url = tls_url(server, pems, client_cert=False, timeout=FAIL_TIMEOUT)
    else:
        url = tls_url(
            server,
            pems,
            timeout=FAIL_TIMEOUT,
            ssl_certfile=pems.stranger,  # its key in the same file
            ssl_keyfile="",
        )
        assert parse(url).tls == ZkTls(ca_certs=pems.ca, certfile=pems.stranger)
    text, took = refused(url)
    assert "the server refused this client's certificate, or its lack of one" in text
    assert "add ssl_certfile=" in text
    assert took < FAIL_TIMEOUT + 3


@needs_zk
def test_the_hostname_check_is_on_by_default_and_off_with_ssl_check_hostname_false(
    server: TlsZkServer, pems: Pems
) -> None:
    """The server's certificate names localhost, not 127.0.0.1."""
    text, took = refused(tls_url(server, pems, host="127.0.0.1", timeout=FAIL_TIMEOUT))
    assert "IP address mismatch" in text
    assert "does not name the host in the URL" in text
    assert took < FAIL_TIMEOUT + 3
    url = tls_url(server, pems, host="127.0.0.1", ssl_check_hostname="false")
    assert parse(url).tls == ZkTls(
        ca_certs=pems.ca, certfile=pems.client_cert, keyfile=pems.client_key, check_hostname=False
    )
    with ZooKeeperBackend(url).acquire("by-ip") as lease:
        assert lease.token > 0
    assert shared(parse(url)).client.check_hostname is False


@needs_zk
def test_tls_to_the_plain_port_says_so(server: TlsZkServer, pems: Pems) -> None:
    url = tls_url(server, pems, timeout=FAIL_TIMEOUT).replace(
        f":{server.secure_port}/", f":{server.client_port}/"
    )
    text, took = refused(url)
    assert "the server closed the connection during the TLS handshake" in text
    assert "use zookeeper://" in text
    assert took < FAIL_TIMEOUT + 3


# -- the URL (no server) ------------------------------------------------------------------------


def test_the_tls_options_round_trip_into_the_parsed_url_and_kazoo(pems: Pems) -> None:
    url = (
        "zookeepers://me:s%40cret@zk1:2281,zk2:2281/app?timeout=7"
        f"&ssl_ca_certs={pems.ca}&ssl_certfile={pems.client_cert}"
        f"&ssl_keyfile={pems.client_key_encrypted}&ssl_password={quote(KEY_PASSWORD, safe='')}"
        "&ssl_cert_reqs=required&ssl_check_hostname=true"
    )
    parsed = parse(url)
    assert (parsed.hosts, parsed.chroot, parsed.timeout) == (
        (("zk1", 2281), ("zk2", 2281)),
        "/app",
        7.0,
    )
    assert parsed.tls == ZkTls(
        ca_certs=pems.ca,
        certfile=pems.client_cert,
        keyfile=pems.client_key_encrypted,
        password=KEY_PASSWORD,
        cert_reqs="required",
        check_hostname=True,
    )
    assert parsed.kazoo_args() == {
        "use_ssl": True,
        "ca": pems.ca,
        "certfile": pems.client_cert,
        "keyfile": pems.client_key_encrypted,
        "keyfile_password": KEY_PASSWORD,
        "verify_certs": True,
        "check_hostname": True,
    }
    assert parsed.shown == (
        f"zookeepers://me:***@zk1:2281,zk2:2281/app?ssl_ca_certs={pems.ca}"
        f"&ssl_certfile={pems.client_cert}&ssl_keyfile={pems.client_key_encrypted}"
        "&ssl_password=***"
    )
    for secret in ("s@cret", KEY_PASSWORD):
        assert secret not in parsed.shown
        assert secret not in repr(parsed)
    # The options are part of the shared client's key: another option, another client.
    assert parsed.client_key() == parse(url).client_key()
    unchecked = parse(url.replace("ssl_check_hostname=true", "ssl_check_hostname=false"))
    assert parsed.client_key() != unchecked.client_key()
    plain, secure = parse("zookeeper://zk1:2281/app"), parse("zookeepers://zk1:2281/app")
    assert plain.client_key() != secure.client_key()
    # Defaults: verified, hostname checked; none turns both off; optional is required.
    assert parse("zookeepers://h1/x").tls == ZkTls()
    assert parse("zookeepers://h1/x?ssl_cert_reqs=none").kazoo_args()["check_hostname"] is False
    assert parse("zookeepers://h1/x?ssl_cert_reqs=optional").kazoo_args()["verify_certs"] is True
    assert parse("zookeeper://h1/x").tls is None
    assert parse("zookeeper://h1/x").kazoo_args() == {}
    assert backend_module(["zookeepers://h1/x"]).__name__ == "celery_dlock.backends.zookeeper"


def test_a_certificate_file_with_its_key_needs_no_ssl_keyfile(pems: Pems) -> None:
    tls = parse(f"zookeepers://h1/x?ssl_certfile={pems.client_both}").tls
    assert tls is not None
    assert tls.kazoo_args()["keyfile"] == pems.client_both  # kazoo loads both or neither


@pytest.mark.parametrize(
    ("options", "says", "fix"),
    [
        ("ssl_ca_certs={missing}", "ssl_ca_certs='{missing}' is not a file", "give the path"),
        ("ssl_ca_certs={not_pem}", "holds no PEM CA certificate", "-----BEGIN CERTIFICATE"),
        ("ssl_certfile={client_cert}", "holds no private key", "add ssl_keyfile="),
        ("ssl_keyfile={client_key}", "ssl_keyfile without ssl_certfile", "add ssl_certfile="),
        (
            "ssl_certfile={client_cert}&ssl_keyfile={wrong_key}",
            "is not the key of ssl_certfile",
            "belong together",
        ),
        (
            "ssl_certfile={client_cert}&ssl_keyfile={client_key_encrypted}",
            "is an encrypted key and no ssl_password is given",
            "add ssl_password=",
        ),
        (
            "ssl_certfile={client_cert}&ssl_keyfile={client_key_encrypted}&ssl_password=nope",
            "ssl_password does not decrypt",
            "the key's password",
        ),
        ("ssl_certfile={not_pem}&ssl_keyfile={client_key}", "not a PEM certificate", "PEM"),
        ("ssl_certfile={client_cert}&ssl_keyfile={not_pem}", "not a PEM certificate", "PEM"),
        ("ssl_certfile={not_pem}", "holds no private key", "add ssl_keyfile="),
    ],
)
def test_bad_tls_files_are_a_config_error_naming_the_option_and_the_fix(
    pems: Pems, options: str, says: str, fix: str
) -> None:
    names = {
        name: getattr(pems, name)
        for name in ("client_cert", "client_key", "client_key_encrypted", "wrong_key", "not_pem")
    }
    names["missing"] = str(pems.directory / "missing.pem")
    with pytest.raises(ConfigError) as caught:
        parse(f"zookeepers://h1/x?{options.format(**names)}", "dlock_urls")
    message = str(caught.value)
    assert message.startswith("dlock_urls: 'zookeepers://h1/x?")
    assert says.format(**names) in message
    assert fix in message.split(";", 1)[1]
    assert "nope" not in message
