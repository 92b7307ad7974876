"""A Sentinel-managed group on 127.0.0.1 for tests: a master, a replica, three sentinels.

The replica replicates through :class:`LinkProxy`, a TCP relay in the test process that can
hold back what the master sends. That makes the asynchronous-replication case exact instead
of a race: freeze the link, take a lock on the master, fail over, and the new master never
saw the lock (redis.io's distributed-locks page: why a failover can lose a lock, and why
Redlock exists).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import redis

from celery_dlock.testing import RedisServer, free_port, server_binary, terminate

SERVICE = "mymaster"
DEADLINE = 20.0


def poll(what: str, check: object, timeout: float = DEADLINE) -> None:
    """Call ``check()`` until it returns true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling another process's state, bounded by the deadline


class LinkProxy:
    """Relays TCP to ``upstream``; :meth:`freeze` holds back what the upstream sends."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="link-proxy").start()

    def freeze(self) -> None:
        """Stop relaying upstream -> downstream; what arrives meanwhile is kept back."""
        self._flowing.clear()

    def close(self) -> None:
        """Cut every relayed connection; anything held back is dropped."""
        self._closed = True
        self._flowing.set()
        with suppress(OSError):  # wakes the accept() in progress; close() alone would not
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in self._sockets:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            self._sockets.append(down)
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                down.close()
                continue
            self._sockets.append(up)
            threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, holdable: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if holdable:
                    self._flowing.wait()
                if self._closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with suppress(OSError):
                dst.shutdown(socket.SHUT_WR)


class Sentinel:
    """One ``redis-server --sentinel`` process watching ``SERVICE``."""

    def __init__(self, master_port: int) -> None:
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="dlock-sentinel-"))
        conf = self.directory / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\n"
            f"dir {self.directory}\nlogfile {self.directory / 'sentinel.log'}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} 2000\n"
            # Long: a sentinel re-points a replica that follows another address (our proxy)
            # once this has passed; the tests end well before.
            f"sentinel failover-timeout {SERVICE} 60000\n"
        )
        self.process = subprocess.Popen(
            [server_binary(), str(conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        self.client = redis.Redis(port=self.port, socket_timeout=5, decode_responses=True)
        poll(f"sentinel :{self.port} to answer", self._up)

    def _up(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    def master_port(self) -> int:
        host_port = self.client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(host_port[1])

    def knows_replica(self, port: int) -> bool:
        replicas = self.client.execute_command("SENTINEL", "REPLICAS", SERVICE)
        for info in replicas:  # redis-py parses each entry into a dict
            if int(info["port"]) == port and "disconnected" not in str(info["flags"]):
                return True
        return False

    def close(self) -> None:
        self.client.close()
        terminate(self.process)
        shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class Group:
    master: RedisServer
    replica: RedisServer
    link: LinkProxy
    sentinels: list[Sentinel]

    @property
    def url(self) -> str:
        """The library's URL for this group: all three sentinels, the service, database 0."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def fail_over(self) -> None:
        """``SENTINEL FAILOVER``, then wait until every sentinel names the replica master
        and the old master has become its replica (it drops its clients as it does)."""
        self.switch()
        self.wait_demoted()

    def switch(self) -> None:
        """``SENTINEL FAILOVER``; returns once every sentinel names the replica master. The
        old master stays a writable master until Sentinel demotes it (about 10 s later)."""
        self.sentinels[0].client.execute_command("SENTINEL", "FAILOVER", SERVICE)
        new = self.replica.port
        poll("the sentinels to name the new master", lambda: all(
            s.master_port() == new for s in self.sentinels
        ))  # fmt: skip

    def switch_back(self) -> None:
        """After :meth:`switch` and :meth:`demote_by_hand`: ``SENTINEL FAILOVER`` again, back to
        the first master, once the sentinels will promote it (asked again while they answer
        that a failover is in progress or that no replica is fit); returns once every sentinel
        names it master."""
        old = self.master.port

        def started() -> bool:
            try:
                self.sentinels[0].client.execute_command("SENTINEL", "FAILOVER", SERVICE)
            except redis.ResponseError:  # INPROG, NOGOODSLAVE: not yet
                return False
            return True

        poll("the sentinels to see the old master as a replica", lambda: all(
            s.knows_replica(old) for s in self.sentinels
        ))  # fmt: skip
        poll("a failover back to start", started)
        poll("the sentinels to name the old master again", lambda: all(
            s.master_port() == old for s in self.sentinels
        ))  # fmt: skip

    def demote_by_hand(self) -> None:
        """What an operator does instead of waiting for Sentinel: ``REPLICAOF`` the new
        master on the old one. Unlike Sentinel's demotion, it keeps its clients."""
        old = redis.Redis(port=self.master.port, socket_timeout=5)
        try:
            old.execute_command("REPLICAOF", "127.0.0.1", str(self.replica.port))
        finally:
            old.close()

    def wait_demoted(self, timeout: float = DEADLINE) -> None:
        """Until the old master follows the new one."""
        new = self.replica.port
        old = redis.Redis(port=self.master.port, socket_timeout=5, decode_responses=True)
        try:
            poll("the old master to follow the new one", lambda: (
                old.info("replication").get("master_port") == new
            ), timeout)  # fmt: skip
        finally:
            old.close()


@contextmanager
def sentinel_group() -> Iterator[Group]:
    """Master, replica (through a :class:`LinkProxy`), three sentinels; all stopped on exit."""
    master = RedisServer().start()
    link = LinkProxy(master.port)
    replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(link.port)]).start()
    sentinels: list[Sentinel] = []
    try:
        probe = redis.Redis(port=replica.port, socket_timeout=5, decode_responses=True)
        try:
            poll("the replica to sync", lambda: (
                probe.info("replication").get("master_link_status") == "up"
            ))  # fmt: skip
        finally:
            probe.close()
        sentinels = [Sentinel(master.port) for _ in range(3)]
        for sentinel in sentinels:
            poll("the sentinels to see the replica", lambda s=sentinel: s.knows_replica(
                replica.port
            ))  # fmt: skip
        yield Group(master, replica, link, sentinels)
    finally:
        for sentinel in sentinels:
            sentinel.close()
        link.close()
        replica.close()
        master.close()
