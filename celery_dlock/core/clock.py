"""A clock and a source of jitter that test libraries leave alone.

Leases, waits and renewals run on ``time.monotonic()``, which a test may replace (freezegun's
``freeze_time``) to move a lease to its expiry. A wait of ``wait`` seconds must still end
when the replaced clock stands still: the backends bound it by :func:`real_clock` as well,
``CLOCK_MONOTONIC`` read through ``time.clock_gettime``, which freezegun does not patch.

Retry sleeps are jittered from the OS (:func:`jitter`), never from the application's global
``random`` state, which a user's seeded or property-based tests rely on; it also differs in each
forked worker process without reseeding.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

_random = random.SystemRandom()
_gettime: Callable[[int], float] | None = getattr(time, "clock_gettime", None)


def real_clock() -> float:
    """Seconds on the system's monotonic clock, whatever a test did to ``time.monotonic``."""
    if _gettime is None:  # Windows: no clock_gettime; perf_counter is patched too, alas
        return time.perf_counter()
    return _gettime(time.CLOCK_MONOTONIC)


def jitter(low: float, high: float) -> float:
    """A random delay in ``[low, high]`` seconds, drawn from the OS (see the module's note)."""
    return _random.uniform(low, high)
