"""Background threads and thread pools belong to one process (``core.background.PerProcess``):
started on first use, made afresh in a forked child (a Celery prefork pool process), even when
a thread of the parent held their locks at the fork, and daemon threads that stop with it.

The four users: the renewal watchdog, the Redis janitor, the ZooKeeper reaper, and the thread
pools (one-shot background work, Redis connecting).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from celery_dlock.backends.redis.connecting import _connector
from celery_dlock.backends.redis.janitor import janitor
from celery_dlock.backends.zookeeper.reaper import reaper
from celery_dlock.core.background import _background, background
from celery_dlock.core.renewal import watchdog

ROOT = Path(__file__).resolve().parents[2]
#: How long the child may take before its checks count as hung (a lock copied held): a bound
#: on a deadlock, not a speed; the checks take milliseconds.
HANG = 30.0


def _child_checks() -> str:
    """In the forked child: each loop's state is fresh and each works; '' or what failed."""
    loops = {"watchdog": watchdog, "janitor": janitor, "reaper": reaper}
    for name, loop in loops.items():
        if loop._running:
            return f"{name}: the parent's thread counted as running in the child"
    if reaper._heap or janitor._heap or watchdog.leases():
        return "the parent's pending work was carried into the child"
    reaped = threading.Event()
    reaper.add(time.monotonic(), reaped.set)
    pooled = threading.Event()
    background(pooled.set)
    connected = _connector.submit(lambda: 1)
    janitor.wake()
    if not reaped.wait(HANG):
        return "the reaper ran no job in the child"
    if not pooled.wait(HANG):
        return "the background pool ran nothing in the child"
    if connected.result(HANG) != 1:
        return "the connecting pool ran nothing in the child"
    names = {thread.name for thread in threading.enumerate()}
    missing = {"dlock-zk-reaper", "dlock-janitor"} - names
    if missing:
        return f"no {missing} thread in the child"
    return ""


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork with threads, 3.12+
def test_a_forked_child_makes_its_own_loops_and_pools_though_the_parent_held_their_locks() -> None:
    # The parent: every thread and pool started, then each lock held by a thread at the fork.
    reaped = threading.Event()
    reaper.add(time.monotonic(), reaped.set)
    assert reaped.wait(HANG)
    background(lambda: None)
    assert _connector.submit(lambda: 1).result(HANG) == 1
    janitor.wake()
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with janitor._cond, reaper._cond, watchdog._lock, _background._lock, _connector._lock:
            holding.set()
            done.wait(HANG)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(HANG)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        out: list[str] = []
        try:

            def check() -> None:
                try:
                    out.append(_child_checks())
                except BaseException as exc:
                    out.append(repr(exc))

            checks = threading.Thread(target=check, daemon=True)
            checks.start()
            checks.join(HANG)
            said = out[0] if out else "hung: a lock was copied held into the child"
        except BaseException as exc:
            said = repr(exc)
        finally:
            os.write(write, (said or "ok").encode())
            os._exit(0)
    done.set()
    holder.join()
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(pid, 0)
    assert said == "ok"


def test_no_background_thread_starts_before_its_first_use() -> None:
    script = (
        "import threading, celery_dlock, celery_dlock.core.renewal, "
        "celery_dlock.backends.redis.janitor, celery_dlock.backends.zookeeper.reaper, "
        "celery_dlock.backends.redis.connecting\n"
        "print(sorted(t.name for t in threading.enumerate() if t.name.startswith('dlock')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
