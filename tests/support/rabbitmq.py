"""A real RabbitMQ broker for the tests: one private ``rabbitmq-server`` per test session.

The server is Debian's ``rabbitmq-server`` package (Erlang), run by hand without its service
wrapper: ``/usr/lib/rabbitmq/bin/rabbitmq-server`` with every port, the node name, the data
and log directories, the plugin list and the Erlang cookie (``HOME``) of this session's own,
on 127.0.0.1 (https://www.rabbitmq.com/configure.html#customise-environment). It shares
nothing with a system broker or another test session: its own AMQP port, distribution port
and ``epmd`` port, all free loopback ports. scripts/test.sh installs the package when it is
missing and it can (root, apt-get); otherwise :func:`skip_reason` gives the one line the
tests skip with.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from celery_dlock.testing import free_port

SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
#: Seconds the broker gets to open its AMQP port (an Erlang VM's cold start takes about 10 s
#: on a busy 2-core host; it is started once per test session).
START_TIMEOUT = 120.0
#: Seconds it gets to stop after SIGTERM before it is killed.
STOP_TIMEOUT = 30.0


def skip_reason() -> str | None:
    """None when a RabbitMQ broker can be started here, else one line saying why not.

    Never installs anything: scripts/test.sh installs the package before pytest starts.
    """
    if not SERVER.exists():
        how = (
            "run scripts/test.sh as root, or apt-get install rabbitmq-server"
            if shutil.which("apt-get")
            else "install RabbitMQ's Debian package (rabbitmq-server)"
        )
        return f"RabbitMQ tests skipped: no RabbitMQ server here ({SERVER} missing); {how}"
    return None


class RabbitServer:
    """One private ``rabbitmq-server`` on free 127.0.0.1 ports, in a directory of its own."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="dlock-rabbitmq-"))
        #: Unique as its directory is (not only by port: two port picks can agree), so that a
        #: broker answering on the port can be told to be this one (:meth:`_ours`).
        self.node = f"dlock-test-{self.directory.name.rsplit('-', 1)[-1]}"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The Celery broker URL (the default ``guest`` user, allowed from loopback only)."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def log(self) -> Path:
        return self.directory / "server.log"

    def _env(self) -> dict[str, str]:
        (self.directory / "enabled_plugins").write_text("[].\n")  # none: a faster start
        return {
            **os.environ,
            "HOME": str(self.directory),  # its own Erlang cookie
            "RABBITMQ_NODENAME": f"{self.node}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_MNESIA_BASE": str(self.directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.directory / "log"),
            "RABBITMQ_PID_FILE": str(self.directory / "rabbitmq.pid"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.directory / "enabled_plugins"),
            # No /etc/rabbitmq files: this broker's config is the defaults.
            "RABBITMQ_CONFIG_FILE": str(self.directory / "rabbitmq"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.directory / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.directory / "rabbitmq-env.conf"),
        }

    def start(self) -> RabbitServer:
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [str(SERVER)],
                env=self._env(),
                cwd=self.directory,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its Erlang VM and helpers: one process group
            )
        try:
            self._wait_ready(self.process)
        except BaseException:  # a failed start, or Ctrl-C meanwhile: leave nothing running
            self.stop()
            raise
        return self

    def _wait_ready(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not (self._listening() and self._ours()):
            if process.poll() is not None:
                raise RuntimeError(
                    f"rabbitmq-server on port {self.port} exited with {process.returncode}: "
                    f"{self.log.read_text(errors='replace')[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rabbitmq-server did not open 127.0.0.1:{self.port} within "
                    f"{START_TIMEOUT:g} s: {self.log.read_text(errors='replace')[-3000:]}"
                )
            time.sleep(0.1)

    def _listening(self) -> bool:
        with socket.socket() as sock:
            sock.settimeout(1.0)
            return sock.connect_ex(("127.0.0.1", self.port)) == 0

    def _ours(self) -> bool:
        """Whether the broker answering on the port is this one (RabbitMQ names its cluster
        after its node by default), not another session's that picked the same port."""
        import amqp  # Celery's own AMQP client (kombu's transport)

        conn = amqp.Connection(
            host=f"127.0.0.1:{self.port}",
            userid="guest",
            password="guest",
            connect_timeout=2,
            read_timeout=2,
            write_timeout=2,
        )
        try:
            conn.connect()
            name = str(conn.server_properties.get("cluster_name", ""))
        except Exception:  # not AMQP, or not ready yet
            return False
        finally:
            with contextlib.suppress(Exception):
                conn.close()
        return name.startswith(f"{self.node}@")

    def stop(self) -> None:
        """SIGTERM the broker's process group (a clean stop), SIGKILL what is left, then stop
        the ``epmd`` it started on its own port (a daemon outside that group)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=STOP_TIMEOUT)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None
        epmd = shutil.which("epmd")
        if epmd is not None:
            subprocess.run(
                [epmd, "-kill"],
                env={**os.environ, "ERL_EPMD_PORT": str(self.epmd_port)},
                capture_output=True,
                timeout=30,
                check=False,
            )
        shutil.rmtree(self.directory, ignore_errors=True)


@contextlib.contextmanager
def rabbitmq() -> Iterator[RabbitServer]:
    """A started broker, stopped (and its directory removed) on exit."""
    server = RabbitServer().start()
    try:
        yield server
    finally:
        server.stop()
