"""celery_dlock.testing's RedisServer: a started server is the process it started."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from celery_dlock.testing import RedisServer


def test_a_port_another_server_holds_fails_the_start_naming_the_port() -> None:
    # Two free-port picks can return the same port. The second redis-server then fails to bind,
    # while the first answers its PING: the start used to return as if the second were up.
    first = RedisServer().start()
    second = RedisServer(port=first.port)
    try:
        with pytest.raises(RuntimeError, match=rf"redis-server on port {first.port} exited"):
            second.start()
        assert first.ping()
    finally:
        second.stop()
        first.stop()


def test_a_server_asking_for_a_password_is_taken_as_started() -> None:
    server = RedisServer(extra_args=["--requirepass", "pw"]).start()
    try:
        assert server.running
    finally:
        server.stop()


def _rabbitmq() -> Any:
    from tests.support import rabbitmq

    reason = rabbitmq.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return rabbitmq


def test_a_broker_port_something_else_holds_fails_the_rabbitmq_start() -> None:
    """Two free-port picks can agree (another test session's broker, a redis-server): the
    start must not take that listener for its own broker and hand out its URL."""
    rabbitmq = _rabbitmq()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        server = rabbitmq.RabbitServer()
        server.port = taken.getsockname()[1]
        try:
            with pytest.raises(
                RuntimeError, match=rf"rabbitmq-server on port {server.port} exited"
            ):
                server.start()
        finally:
            server.stop()


CHILD = """
import signal, sys
sys.path.insert(0, {root!r})
from tests.support.rabbitmq import RabbitServer

def interrupt(signum, frame):
    raise KeyboardInterrupt

server = RabbitServer()
print(server.directory, server.epmd_port, flush=True)
signal.signal(signal.SIGALRM, interrupt)
signal.setitimer(signal.ITIMER_REAL, {after})  # Ctrl-C while the broker boots
try:
    server.start()
    print("started", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def _processes_under(directory: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if directory.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


def test_a_rabbitmq_start_interrupted_leaves_no_broker_and_no_epmd(tmp_path: Path) -> None:
    rabbitmq = _rabbitmq()
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(root=root, after=1.0)],
        capture_output=True, text=True, timeout=rabbitmq.START_TIMEOUT + rabbitmq.STOP_TIMEOUT,
        check=False,
    )  # fmt: skip
    directory, epmd_port = done.stdout.split("\n", 1)[0].split()
    left = _processes_under(directory)
    with socket.socket() as sock:
        epmd_alive = sock.connect_ex(("127.0.0.1", int(epmd_port))) == 0
    for pid in left:  # what this test started, whatever the outcome
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if epmd_alive:
        env = {**os.environ, "ERL_EPMD_PORT": epmd_port}
        subprocess.run(["epmd", "-kill"], env=env, capture_output=True, timeout=30, check=False)
    shutil.rmtree(directory, ignore_errors=True)
    if "started" in done.stdout:
        pytest.skip("the broker started before the interruption; nothing to see")
    assert "interrupted" in done.stdout, done.stdout + done.stderr
    assert left == [], f"broker processes left running: {left}"
    assert not epmd_alive, f"epmd left running on port {epmd_port}"
