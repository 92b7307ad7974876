"""Instructions one task costs in the process that runs it, counted by valgrind (callgrind).

Noise on a shared host moves the CPU and wall figures of ``task_path.py`` by more than the
lock's own work; instruction counts do not move. For each row of ``task_path.py`` (``plain``,
``floor``, ``floor_release``, ``floor_fenced``, ``dlock``) this runs, under ``valgrind
--tool=callgrind``, a process that warms the row up with 200 tasks (connections open, scripts
loaded) and then runs N tasks through Celery's tracer as a prefork child does, for N = 100 and
N = 400; instructions per task = (total at 400 - total at 100) / 300, so start-up and warm-up
cancel out. ``PYTHONHASHSEED=0``. ``--gc-off`` collects and then disables the cyclic GC after
the warm-up: a full collection falling inside one window and not the other moves a row by up to
50k. What remains is a few thousand instructions from the lock's background threads (watchdog,
janitor), which wake on the clock, not per task.

Opcodes per task and file of ``celery_dlock`` (``--opcodes``, ``sys.settrace``, no valgrind)
say where the lock's own Python goes.

Run: ``.venv/bin/python benchmarks/task_instructions.py [--rows dlock floor_release] [--gc-off]
[--opcodes]`` (valgrind must be installed; about a minute per row).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import callgrind_total

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WARMUP = 200
SMALL, LARGE = 100, 400


def _rows(urls: list[str]) -> tuple[object, dict[str, object]]:
    """The app and tasks of ``task_path.py``, set up as a prefork child runs them."""
    from celery.app.trace import setup_worker_optimizations
    from task_path import make_app

    app, tasks = make_app(urls[0], urls[1])
    setup_worker_optimizations(app, "bench")
    return app, tasks


def child(rows: list[str], count: int, urls: list[str], gc_off: bool, opcodes: bool) -> None:
    """Run each row ``count`` times after its warm-up, in this process (valgrind counts it)."""
    import gc

    from task_path import runner

    app, tasks = _rows(urls)
    for row in rows:
        run = runner(app, tasks[row])
        run(0, WARMUP)
        if gc_off:
            gc.collect()
            gc.disable()
        if not opcodes:
            run(WARMUP, count)
            continue
        total, per_file = _opcodes(run, count)
        gc.enable()
        print(f"{row}: {total / count:.0f} opcodes per task; celery_dlock's by file:")
        for name, n in per_file.most_common():
            print(f"  {n / count:7.1f}  {name}")


def _opcodes(run: Any, count: int) -> tuple[int, collections.Counter[str]]:
    """Opcodes ``run(WARMUP, count)`` executes: in all, and per file of ``celery_dlock``."""
    per_file: collections.Counter[str] = collections.Counter()
    total = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal total
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            total += 1
            name = frame.f_code.co_filename
            if "celery_dlock" in name:
                per_file[name[name.rindex("celery_dlock") :]] += 1
        return tracer

    sys.settrace(tracer)
    try:
        run(WARMUP, count)
    finally:
        sys.settrace(None)
    return total, per_file


def collected(row: str, count: int, urls: list[str], gc_off: bool, out: Path) -> int:
    """Instructions callgrind collected for one child run of ``count`` tasks."""
    argv = [__file__, "--child", row, str(count), *urls] + (["--gc-off"] if gc_off else [])
    return callgrind_total(argv, out, row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", nargs="+", default=["plain", "floor", "floor_release", "floor_fenced", "dlock"]
    )
    parser.add_argument("--gc-off", action="store_true", help="no cyclic GC after warm-up")
    parser.add_argument("--opcodes", action="store_true", help="opcodes per file, no valgrind")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        row, count, *urls = args.child
        child([row], int(count), urls, args.gc_off, args.opcodes)
        return
    from celery_dlock.testing import redis_servers

    with redis_servers(2) as servers, tempfile.TemporaryDirectory() as tmp:
        urls = [s.url for s in servers]
        if args.opcodes:
            child(args.rows, SMALL, urls, args.gc_off, True)
            return
        for row in args.rows:
            small = collected(row, SMALL, urls, args.gc_off, Path(tmp, f"{row}.small"))
            large = collected(row, LARGE, urls, args.gc_off, Path(tmp, f"{row}.large"))
            per_task = (large - small) / (LARGE - SMALL)
            print(f"{row:<14} {per_task / 1000:9.1f}k instructions per task", flush=True)


if __name__ == "__main__":
    main()
