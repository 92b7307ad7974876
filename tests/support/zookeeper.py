"""Real ZooKeeper servers for the tests: a standalone server and a three-node ensemble.

The server is Debian's ``zookeeper`` package (its jar and dependencies under
``/usr/share/java``), run by hand with our own config file and data directory: ``java -cp
/usr/share/java/zookeeper.jar org.apache.zookeeper.server.quorum.QuorumPeerMain <cfg>``
(https://zookeeper.apache.org/doc/current/zookeeperStarted.html). scripts/test.sh installs
the package when it is missing and it can (root, apt-get); otherwise :func:`skip_reason`
returns the one line the tests skip with.

Every server listens on 127.0.0.1 on free ports (client, quorum and election ports) and is
stopped by its PID. Start-up is kept short: tickTime 200 ms, a small serial-GC heap, no admin
server, no fsync. Faults between a client and a server come from :class:`FaultProxy`
(``tests/support/proxy.py``), whose ``blackhole()`` stops forwarding either way and ``heal()``
resumes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.support.proxy import FaultProxy

__all__ = [
    "CHROOT",
    "QUEUED_LOCKS",
    "QUEUED_REASON",
    "TICK_MS",
    "Ensemble",
    "FaultProxy",
    "ZkServer",
    "delete_holder",
    "ensemble",
    "four_letter",
    "skip_reason",
    "standalone",
    "until",
    "wipe",
]

JAR = Path("/usr/share/java/zookeeper.jar")
#: Queued locks (``lock_on="enqueue"``, a retry handing its key over) on ZooKeeper: the
#: behaviour tests marked ``queued_locks`` run there (False would skip them there).
QUEUED_LOCKS = True
QUEUED_REASON = "queued locks on ZooKeeper not yet built"
#: Where the behaviour tests' locks live on the shared test server (wiped before each test).
CHROOT = "/celery-dlock-test"
MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
#: tickTime of every test server, in ms: sessions may last 2 to 300 ticks (0.4 s to 60 s).
TICK_MS = 200
#: Seconds a server gets to answer after start (a cold JVM on a busy 2-core host).
START_TIMEOUT = 60.0
JAVA_OPTS = [
    "-Xmx96m",
    "-Xss512k",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",  # C1 only: a faster start, enough for tests
    "-Dzookeeper.admin.enableServer=false",
    "-Dzookeeper.4lw.commands.whitelist=*",
    # Empty container nodes (a key's parent) are deleted after at most this (default: 60 s).
    "-Dznode.container.checkIntervalMs=500",
]


def skip_reason() -> str | None:
    """None when a ZooKeeper server can be started here, else one line saying why not.

    Never installs anything: scripts/test.sh installs the package before pytest starts (two
    xdist processes running apt-get at once would fight over dpkg's lock).
    """
    if not JAR.exists():
        how = (
            "run scripts/test.sh as root, or apt-get install zookeeper"
            if shutil.which("apt-get")
            else "install Apache ZooKeeper's Debian package (zookeeper)"
        )
        return f"ZooKeeper tests skipped: no ZooKeeper server here ({JAR} missing); {how}"
    if shutil.which("java") is None:
        return "ZooKeeper tests skipped: ZooKeeper is installed but no java is on PATH"
    return None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies (Linux's
    PR_SET_PDEATHSIG), so a test run killed by a timeout leaves no server behind."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (all held open until all are found)."""
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    try:
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def four_letter(port: int, command: str, timeout: float = 1.0) -> str:
    """Send a four-letter-word command (``ruok``, ``srvr``, ``mntr``...) and return the answer;
    empty on any connection error."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(command.encode())
            chunks = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
            return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""


class ZkServer:
    """One ZooKeeper server process (standalone or a member of an ensemble)."""

    def __init__(
        self,
        root: Path,
        client_port: int,
        *,
        myid: int = 0,
        peers: dict[int, tuple[int, int]] | None = None,
    ) -> None:
        self.myid = myid
        self.client_port = client_port
        self.dir = root / f"zk{myid}"
        self.data = self.dir / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.cfg = self.dir / "zoo.cfg"
        lines = [
            f"tickTime={TICK_MS}",
            "initLimit=10",
            "syncLimit=5",
            f"dataDir={self.data}",
            f"clientPort={client_port}",
            "clientPortAddress=127.0.0.1",
            "minSessionTimeout=400",
            "maxSessionTimeout=60000",
            "admin.enableServer=false",
            "4lw.commands.whitelist=*",
            "forceSync=no",  # tests only: no fsync per transaction
            "preAllocSize=4096",  # KB: a small transaction log file to create
            "maxClientCnxns=0",
        ]
        if peers:
            (self.data / "myid").write_text(f"{myid}\n")
            lines += [f"server.{i}=127.0.0.1:{q}:{e}" for i, (q, e) in sorted(peers.items())]
        self.cfg.write_text("\n".join(lines) + "\n")
        self.log = self.dir / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Launch the JVM (returns at once; :meth:`wait_serving` waits for it)."""
        if self.running:
            return
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                ["java", *JAVA_OPTS, "-cp", f"{JAR}", MAIN, str(self.cfg)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C of the test run does not reach it first
                preexec_fn=_die_with_parent,  # noqa: PLW1509 (one prctl call, no locks)
            )

    def mode(self) -> str | None:
        """``standalone``, ``leader`` or ``follower`` while serving clients; else None."""
        for line in four_letter(self.client_port, "srvr").splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return None

    def serving(self) -> bool:
        return self.mode() is not None

    def wait_serving(self, timeout: float = START_TIMEOUT) -> None:
        """Poll ``srvr`` until the server serves clients (``ruok`` says imok before that)."""
        deadline = time.monotonic() + timeout
        while not self.serving():
            if not self.running:
                raise RuntimeError(f"ZooKeeper server {self.myid} exited: {self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ZooKeeper server {self.myid} not serving: {self.tail()}")
            time.sleep(0.05)  # polling a starting JVM, bounded by the deadline

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop by PID: SIGTERM (SIGKILL when ``kill``, or when TERM is not enough)."""
        process = self.process
        if process is None:
            return
        self.process = None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout)

    def restart(self) -> None:
        self.stop()
        self.start()
        self.wait_serving()

    def tail(self, lines: int = 5) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:])


class Ensemble:
    """A ZooKeeper ensemble of ``size`` servers on loopback ports."""

    def __init__(self, root: Path, size: int = 3) -> None:
        ports = free_ports(3 * size)
        peers = {i + 1: (ports[3 * i + 1], ports[3 * i + 2]) for i in range(size)}
        self.servers = [ZkServer(root, ports[3 * i], myid=i + 1, peers=peers) for i in range(size)]

    @property
    def hosts(self) -> str:
        """The connect string of every member."""
        return ",".join(s.hosts for s in self.servers)

    def start(self, timeout: float = START_TIMEOUT) -> None:
        for server in self.servers:
            server.start()
        deadline = time.monotonic() + timeout
        for server in self.servers:
            server.wait_serving(max(1.0, deadline - time.monotonic()))

    def leader(self, timeout: float = 30.0) -> ZkServer:
        """The member that says it leads (after an election, the new one)."""
        deadline = time.monotonic() + timeout
        while True:
            for server in self.servers:
                if server.running and server.mode() == "leader":
                    return server
            if time.monotonic() > deadline:
                raise RuntimeError("no ZooKeeper leader")
            time.sleep(0.05)  # polling an election, bounded by the deadline

    def stop(self) -> None:
        for server in self.servers:
            server.stop(kill=True)


def wipe(hosts: str, path: str = CHROOT) -> None:
    """Delete ``path`` and every node under it: an empty lock store for the next test (as
    ``FLUSHDB`` gives the Redis modes)."""
    from kazoo.client import KazooClient
    from kazoo.exceptions import NoNodeError

    client = KazooClient(hosts=hosts, timeout=5.0)
    client.start(timeout=START_TIMEOUT)
    try:
        with contextlib.suppress(NoNodeError):
            client.delete(path, recursive=True)
    finally:
        client.stop()
        client.close()


def delete_holder(url: str, key: str) -> bool:
    """Delete the node that holds ``key`` under the lock store ``url``, as a client of our own
    (an operator, or a bug, deleting the lock behind the holder's back); True if one did."""
    from kazoo.client import KazooClient
    from kazoo.exceptions import NoNodeError

    from celery_dlock.backends.zookeeper import ZooKeeperBackend

    backend = ZooKeeperBackend(url)
    client = KazooClient(hosts=backend.url.connect_string, timeout=5.0)
    client.start(timeout=START_TIMEOUT)
    try:
        parent = backend.parent(key)
        try:
            children = client.get_children(parent)
        except NoNodeError:
            return False
        if not children:
            return False
        lowest = min(children, key=lambda name: int(name[-10:]))
        try:
            client.delete(f"{parent}/{lowest}")
        except NoNodeError:
            return False
        return True
    finally:
        client.stop()
        client.close()


@contextlib.contextmanager
def standalone() -> Iterator[ZkServer]:
    """A standalone server on a free port, killed (by PID) and its files removed at exit."""
    with tempfile.TemporaryDirectory(prefix="dlock-zk-") as root:
        server = ZkServer(Path(root), free_ports(1)[0])
        try:
            server.start()
            server.wait_serving()
            yield server
        finally:
            server.stop(kill=True)


@contextlib.contextmanager
def ensemble(size: int = 3) -> Iterator[Ensemble]:
    """A ``size``-server ensemble, every member killed (by PID) at exit."""
    with tempfile.TemporaryDirectory(prefix="dlock-zk-ens-") as root:
        group = Ensemble(Path(root), size)
        try:
            group.start()
            yield group
        finally:
            group.stop()


if __name__ == "__main__":  # python -m tests.support.zookeeper: time a start of each
    reason = skip_reason()
    if reason:
        raise SystemExit(reason)
    t0 = time.monotonic()
    with standalone() as one:
        print(f"standalone serving in {time.monotonic() - t0:.2f} s ({one.hosts})")
    t0 = time.monotonic()
    with ensemble() as three:
        print(f"3-node ensemble serving in {time.monotonic() - t0:.2f} s ({three.hosts})")
        print("leader:", three.leader().myid)


def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``check`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)  # a poll, bounded by the deadline
