"""Instructions one lock cycle of ``lock_cycle.py`` costs its client process, by callgrind.

``lock_cycle.py``'s timings move by 5-10 % between runs on a shared host, more than what
``lock()`` adds to the manager path. Instruction counts do not move, so this says what the
wrapper costs: for each row (``ours-1`` the manager with ``renew=False``, ``ours-1r`` with
renewal, ``lock-urls-1`` and ``lock-app-1`` the public API, ``raw``, ``scripts-1``) it runs,
under ``valgrind --tool=callgrind``, a process that warms the row up with 300 cycles and then
runs N more, for N = 100 and N = 400: instructions per cycle = (total at 400 - total at 100) /
300, so start-up and warm-up cancel out. ``PYTHONHASHSEED=0``; the cyclic GC is collected
and disabled after the warm-up. Only the client process is counted, not the servers.

Run: ``.venv/bin/python benchmarks/cycle_instructions.py [--rows ours-1r lock-urls-1]``
(valgrind must be installed; about half a minute per row).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

from _common import callgrind_total

WARMUP = 300
SMALL, LARGE = 100, 400
ROWS = ["raw", "scripts-1", "ours-1", "ours-1r", "lock-urls-1", "lock-app-1"]


def child(row: str, count: int, urls: list[str]) -> None:
    """Run ``row``'s cycle ``count`` times after its warm-up, in this process."""
    from lock_cycle import build_variants

    variants = {v.name: v for v in build_variants(urls[0], urls[1:])}
    op = variants[row].op
    for _ in range(WARMUP):
        op()
    gc.collect()
    gc.disable()
    for _ in range(count):
        op()


def collected(row: str, count: int, urls: list[str], out: Path) -> int:
    """Instructions callgrind collected for one child run of ``count`` cycles."""
    return callgrind_total([__file__, "--child", row, str(count), *urls], out, row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=ROWS)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        row, count, *urls = args.child
        child(row, int(count), urls)
        return
    from celery_dlock.testing import redis_servers

    # lock_cycle's variants need one server for the single rows and five for Redlock.
    with redis_servers(6) as servers, tempfile.TemporaryDirectory() as tmp:
        urls = [s.url for s in servers]
        for row in args.rows:
            small = collected(row, SMALL, urls, Path(tmp, f"{row}.small"))
            large = collected(row, LARGE, urls, Path(tmp, f"{row}.large"))
            per_cycle = (large - small) / (LARGE - SMALL)
            print(f"{row:<12} {per_cycle / 1000:8.1f}k instructions per cycle", flush=True)


if __name__ == "__main__":
    main()
