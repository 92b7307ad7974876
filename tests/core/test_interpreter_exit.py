"""A lease held by a thread of the program while the interpreter exits goes on being renewed.

When the main thread ends, Python first shuts its thread pools down (they refuse new work) and
only then waits for the program's own non-daemon threads, which may still be inside a lock.
The renewal watchdog must keep their leases alive through that wait, not fail each round.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from celery_dlock import lock

    urls = sys.argv[1].split(",")
    TTL = 0.6
    held = threading.Event()

    def worker():
        with lock(urls, "exit-holding", ttl=TTL) as lease:
            held.set()
            # Outlive the main thread by several ttls: the interpreter is exiting meanwhile.
            time.sleep(5 * TTL)
            print(f"lost={lease.lost} renewals={lease.renewals}", flush=True)

    threading.Thread(target=worker).start()  # non-daemon: the interpreter waits for it
    held.wait(10)
    """
)


@pytest.mark.parametrize("nodes", [1, 3], ids=["single", "redlock3"])
def test_a_lease_held_while_the_interpreter_exits_is_still_renewed(
    redlock_urls: list[str], nodes: int
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(redlock_urls[:nodes])],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "watchdog round failed" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.startswith("lost=False renewals="), (done.stdout, done.stderr[-3000:])
    assert int(done.stdout.split("renewals=")[1]) >= 3, done.stdout
