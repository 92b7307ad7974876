"""What one uncontended lock cycle asks of the Python interpreter (issue 35), counted with
``sys.setprofile`` on a real server, never timed. ``benchmarks/README.md`` ("Folders that are
the layers (issue 35): instruction counts") has the instruction counts these calls make up.

The counting runs in a fresh interpreter: in a test process that has run other modules, a
profiler on every C call slowed one cycle past pytest-timeout (twice in whole-suite runs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: String searches that parse their arguments (a tuple, then a format), which cost more
#: than the search itself: about 1.1k instructions each; a lock cycle ran three (the void key
#: at acquire, the owner and the nonce at release).
SEARCHES = {"str.index", "str.find", "str.rindex", "str.rfind"}

COUNT = """
import json, sys
from collections import Counter
from celery_dlock import lock
from celery_dlock.backends.redis.redlock import LockManager
from celery_dlock.core.config import Settings

url, how = sys.argv[1], sys.argv[2]
manager = LockManager(Settings(urls=(url,)))

def cycle():
    if how == "manager":
        manager.acquire("cycle-cost", ttl=10, renew=False).release()
    else:
        with lock([url], "cycle-cost", ttl=10):
            pass

counts = Counter()

def profile(frame, event, arg):
    if event == "c_call":
        counts[getattr(arg, "__qualname__", None) or type(arg).__qualname__] += 1

cycle()  # connect and load the scripts first
sys.setprofile(profile)
try:
    for _ in range(10):
        cycle()
finally:
    sys.setprofile(None)
manager.close()
print(json.dumps(counts))
"""


def _builtin_calls(url: str, how: str) -> dict[str, int]:
    """The calls of built-in functions and methods 10 cycles make (``how``: "manager" for a
    backend's acquire + release, "lock" for a ``with lock(...)`` block)."""
    done = subprocess.run(
        [sys.executable, "-c", COUNT, url, how],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    counts: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
    return counts


@pytest.mark.parametrize("how", ["manager", "lock"])
def test_a_lock_cycle_searches_no_string(single_urls: list[str], how: str) -> None:
    counts = _builtin_calls(single_urls[0], how)
    assert counts["socket.sendall"] == 20, counts  # the cycle ran: two commands each time
    assert {name: n for name, n in counts.items() if name in SEARCHES} == {}
