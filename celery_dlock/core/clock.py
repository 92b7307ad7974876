"""A clock that test libraries leave alone, for bounds that must end in real time.

Leases, waits and renewals run on ``time.monotonic()``, which a test may replace (freezegun's
``freeze_time``) to move a lease to its expiry. A wait of ``wait`` seconds must still end
when the replaced clock stands still: the backends bound it by :func:`real_clock` as well,
``CLOCK_MONOTONIC`` read through ``time.clock_gettime``, which freezegun does not patch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_gettime: Callable[[int], float] | None = getattr(time, "clock_gettime", None)


def real_clock() -> float:
    """Seconds on the system's monotonic clock, whatever a test did to ``time.monotonic``."""
    if _gettime is None:  # Windows: no clock_gettime; perf_counter is patched too, alas
        return time.perf_counter()
    return _gettime(time.CLOCK_MONOTONIC)
