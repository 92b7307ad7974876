"""What both benchmarks share: CPU placement and a description of the machine and the code."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import redis

import celery_dlock
from celery_dlock.testing import RedisServer


def pin(servers: Sequence[RedisServer], mode: str) -> str:
    """Place this process (and so the processes it starts later) and the servers on CPUs.

    ``split``: this process on the first allowed CPU, the servers on the others (like a client
    and servers on different hosts); ``same``: all on the first CPU; ``none``: the scheduler
    decides. Returns a description of what was done.
    """
    if mode == "none" or not hasattr(os, "sched_setaffinity"):
        return "none (scheduler decides)"
    cpus = sorted(os.sched_getaffinity(0))
    if mode == "split" and len(cpus) < 2:
        mode = "same"
    client_cpus = {cpus[0]}
    server_cpus = set(cpus[1:]) if mode == "split" else client_cpus
    os.sched_setaffinity(0, client_cpus)
    for server in servers:
        assert server.process is not None, "server not started"
        os.sched_setaffinity(server.process.pid, server_cpus)
    return f"{mode} (clients on CPU {sorted(client_cpus)}, servers on {sorted(server_cpus)})"


def code_version() -> str:
    """Where celery_dlock was imported from, and its git commit when that is a checkout."""
    here = Path(celery_dlock.__file__).resolve().parent

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(here), *args], capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", ".")
    except (OSError, subprocess.CalledProcessError):
        return f"{here} (not a git checkout)"
    return f"{here} (git {commit}{', with uncommitted changes' if dirty else ''})"


def machine(*dists: str) -> dict[str, Any]:
    """CPU, versions and the code measured."""

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                cpu,
            )
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "redis-py": redis.__version__,
        "hiredis": version("hiredis"),
        **{dist: version(dist) for dist in dists},
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "celery_dlock": code_version(),
    }


class ReleasingFloor:
    """SET NX PX with a round trip, then a DEL whose reply is read only before the next command:
    the two commands an execution-time lock cannot do without (take the key; give it back
    without making the task wait), and nothing else (no ownership check, renewal, fencing)."""

    def __init__(self, url: str) -> None:
        self.conn = redis.Redis.from_url(url).connection_pool.get_connection()
        self.unread = False

    def take(self, key: str) -> None:
        if self.unread:
            self.conn.read_response()
        self.conn.send_command("SET", key, "1", "NX", "PX", 30000)
        self.conn.read_response()
        self.unread = False

    def give_back(self, key: str) -> None:
        self.conn.send_command("DEL", key)
        self.unread = True


class FencedFloor:
    """The least a lock with our guarantees must send (issue 34): ``SET key token NX PX`` and
    a fence ``INCR`` in one pipeline (one round trip), and at the end a compare-and-delete
    script whose reply is read only before the next command. No renewal, no waking, no void
    markers: the key expires if the task dies."""

    COMPARE_AND_DELETE = (
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
        "return 0"
    )

    def __init__(self, url: str) -> None:
        client = redis.Redis.from_url(url)
        self.sha = client.script_load(self.COMPARE_AND_DELETE)
        self.conn = client.connection_pool.get_connection()
        self.unread = False
        self.token = ""

    def take(self, key: str) -> None:
        if self.unread:
            self.conn.read_response()
        self.token = os.urandom(12).hex()
        self.conn.send_packed_command(
            self.conn.pack_commands(
                [("SET", key, self.token, "NX", "PX", 30000), ("INCR", key + ":fence")]
            )
        )
        self.conn.read_response()
        self.conn.read_response()
        self.unread = False

    def give_back(self, key: str) -> None:
        self.conn.send_command("EVALSHA", self.sha, 1, key, self.token)
        self.unread = True


def callgrind_total(argv: Sequence[str], out: Path, what: str) -> int:
    """Instructions callgrind counts in the whole run of ``argv`` (a Python command line),
    with ``PYTHONHASHSEED=0`` so that runs of one row compare."""
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, *argv]
    env = dict(os.environ, PYTHONHASHSEED="0")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or found is None:
        raise RuntimeError(f"callgrind run of {what} failed: {done.stderr[-2000:]}")
    return int(found.group(1))
