"""CPU one task costs in the process that runs it: plain, one bare round trip, SingletonTask.

The Celery rows of ``celery_throughput.py`` vary by 10-30 % from round to round on a small VM,
more than the lock's own cost. This runs the part that the lock changes, in one process and
without a worker: Celery's tracer, as a prefork child calls it (``fast_trace_task`` after
``setup_worker_optimizations``), with the result stored in a real Redis backend. Rows:

* ``plain``  a plain task
* ``floor``  a plain task whose body makes one ``SET key 1 NX PX 30000`` round trip (redis-py)
  to the lock Redis: the least any lock taken in the worker costs
* ``floor_release``  ``floor`` plus a ``DEL`` of the key after the body, its reply read before
  the next command (as ``SingletonTask`` sends its release): the two commands an
  execution-time lock that frees its key cannot do without
* ``floor_fenced``  ``SET NX PX`` and a fence ``INCR`` in one round trip, and a
  compare-and-delete sent after the body (``_common.FencedFloor``, as in
  ``celery_throughput.py``): the least a lock with our guarantees must do in the worker
* ``dlock``  ``SingletonTask`` (execution-time lock, single Redis, distinct keys)

Per task: user and system CPU of this process (``os.times``) and wall time. Rows are
interleaved over ``--rounds`` rounds; medians over rounds, and ratios to ``plain`` and
``floor``. Two ``redis-server`` processes on 127.0.0.1: the lock Redis and the backend.

Run: ``.venv/bin/python benchmarks/task_path.py [--tasks N] [--rounds R] [--profile] [--json]``
(``--profile`` prints cProfile's busiest functions of ``celery_dlock`` for the dlock row, to
stderr).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from _common import FencedFloor, ReleasingFloor, machine, pin
from celery import Celery
from celery.app.trace import build_tracer, fast_trace_task, setup_worker_optimizations

from celery_dlock import SingletonTask
from celery_dlock.testing import redis_servers

ROWS = ("plain", "floor", "floor_release", "dlock")


def make_app(lock_url: str, backend_url: str) -> tuple[Celery, dict[str, Any]]:
    app = Celery("task_path", broker=lock_url, backend=backend_url)
    app.conf.update(dlock_urls=[lock_url])
    floor_client = redis.Redis.from_url(lock_url)

    @app.task(name="path.plain")
    def plain(n: int) -> int:
        return n

    @app.task(name="path.floor")
    def floor(n: int) -> int:
        floor_client.set(f"path:floor:{n}", "1", nx=True, px=30000)
        return n

    def between(name: str, around: ReleasingFloor | FencedFloor) -> Any:
        """A task whose body runs between ``around.take`` and ``around.give_back`` of its key."""

        @app.task(name=f"path.{name}")
        def task(n: int) -> int:
            key = f"path:{name}:{n}"
            around.take(key)
            try:
                return n
            finally:
                around.give_back(key)

        return task

    floor_release = between("floor_release", ReleasingFloor(lock_url))
    floor_fenced = between("floor_fenced", FencedFloor(lock_url))

    @app.task(name="path.dlock", base=SingletonTask)
    def dlock(n: int) -> int:
        return n

    rows = {"plain": plain, "floor": floor, "floor_release": floor_release, "dlock": dlock}
    return app, {**rows, "floor_fenced": floor_fenced}


def runner(app: Celery, task: Any) -> Callable[[int, int], None]:
    """Run ``count`` tasks with distinct arguments from ``first`` on, as a pool child does."""
    task.__trace__ = build_tracer(task.name, task, app.loader, "bench", app=app)
    delivery = {"exchange": "", "routing_key": "celery"}

    def run(first: int, count: int) -> None:
        for n in range(first, first + count):
            task_id = str(uuid.uuid4())
            request = {"id": task_id, "task": task.name, "delivery_info": delivery}
            fast_trace_task(task.name, task_id, request, ((n,), {}, {}), None, None)

    return run


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with redis_servers(2) as servers:
        placement = pin(servers, args.pin)
        app, tasks = make_app(servers[0].url, servers[1].url)
        setup_worker_optimizations(app, "bench")
        runs = {row: runner(app, tasks[row]) for row in ROWS}
        start = 0
        for run in runs.values():  # connections open, scripts loaded, tracers warm
            run(start, args.warmup)
            start += args.warmup
        rounds: dict[str, list[dict[str, float]]] = {row: [] for row in ROWS}
        for rnd in range(args.rounds):
            for row in ROWS if rnd % 2 == 0 else ROWS[::-1]:
                t0, w0 = os.times(), time.perf_counter()
                runs[row](start, args.tasks)
                t1, w1 = os.times(), time.perf_counter()
                start += args.tasks
                rounds[row].append(
                    {
                        "user_us": 1e6 * (t1.user - t0.user) / args.tasks,
                        "sys_us": 1e6 * (t1.system - t0.system) / args.tasks,
                        "wall_us": 1e6 * (w1 - w0) / args.tasks,
                    }
                )
        if args.profile:  # to stderr, so that --json output stays one object
            profiler = cProfile.Profile()
            profiler.enable()
            runs["dlock"](start, args.tasks)
            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(
                "celery_dlock", 25
            )
    figures = {
        row: {
            fig: round(statistics.median(r[fig] for r in per), 1)
            for fig in ("user_us", "sys_us", "wall_us")
        }
        for row, per in rounds.items()
    }
    for f in figures.values():
        f["cpu_us"] = round(f["user_us"] + f["sys_us"], 1)
    return {
        "machine": machine("celery"),
        "settings": {
            "tasks": args.tasks,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "pin": placement,
        },
        "figures": figures,
        "rounds": rounds,
    }


def print_report(result: dict[str, Any]) -> None:
    m, s, figs = result["machine"], result["settings"], result["figures"]
    print(
        f"Python {m['python']}, celery {m['celery']}, redis-py {m['redis-py']}, "
        f"hiredis {m['hiredis']}; {m['nproc']} CPU(s): {m['cpu']}"
    )
    print(f"celery_dlock: {m['celery_dlock']}")
    print(f"CPU placement: {s['pin']}")
    print(f"{s['tasks']} tasks per row and round, {s['rounds']} rounds; medians over rounds\n")
    print(f"{'row':<13} {'user us':>8} {'sys us':>7} {'CPU us':>7} {'wall us':>8}  CPU - plain")
    for row, f in figs.items():
        extra = f["cpu_us"] - figs["plain"]["cpu_us"]
        print(
            f"{row:<13} {f['user_us']:>8.1f} {f['sys_us']:>7.1f} {f['cpu_us']:>7.1f} "
            f"{f['wall_us']:>8.1f}  {extra:>+8.1f}"
        )
    print("\nratios (of medians)")
    pairs = (
        ("floor", "plain"),
        ("floor_release", "plain"),
        ("dlock", "plain"),
        ("dlock", "floor"),
        ("dlock", "floor_release"),
    )
    for row, base in pairs:
        for fig in ("cpu_us", "wall_us"):
            print(f"  {row}/{base} {fig:<8} {figs[row][fig] / figs[base][fig]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5000, help="tasks per row and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--pin", choices=("split", "same", "none"), default="split")
    parser.add_argument("--profile", action="store_true", help="cProfile the dlock row")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_report(result)


if __name__ == "__main__":
    main()
