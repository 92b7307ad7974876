"""Where a Celery prefork worker spends its CPU per task: by process, thread, system call.

``celery_throughput.py`` records the worker's CPU per task, but its throughput figures move
with the host's other load. This runs the same worker set-up (the same app, servers and
``celery worker -P prefork -c 2``, a fresh worker per row and round, the tasks queued first
and then consumed at once) and counts only what noise on a shared host does not move much:

* CPU time per task of every thread of the worker's main process and of its pool children:
  user and system time (``/proc/<pid>/task/<tid>/stat``, clock ticks) and the scheduler's
  run time (``/proc/.../schedstat``, nanoseconds); threads are named by their Python name
  (the app sets each thread's OS name under ``BENCH_PROBE``);
* voluntary and involuntary context switches per task, per thread (``/proc/.../status``);
* cyclic-GC collections per task and the time they took, per generation (every process logs
  them; main process and children apart);
* the lock Redis's CPU per task (``INFO cpu``) and its commands per task with the server's
  own time in them (``INFO commandstats``): the servers share the host's CPUs with the worker;
* with ``--callgrind N``, instructions per task of a ``-P solo`` worker, which consumes and
  runs the tasks in one process (valgrind's callgrind, the whole worker run under it;
  counters zeroed with ``callgrind_control -z`` after the warm-up and read with ``-e Ir``
  once N results are stored; ``PYTHONHASHSEED=0``): what CPU time only estimates, in a real
  worker. Solo, because callgrind_control reaches only the process valgrind started, not
  the children a prefork worker forks;
* with ``--strace``, system calls per task by name, main process and pool children apart
  (``strace -c -f``, attached after the warm-up and detached once every result is stored;
  strace slows the worker, so its CPU figures come from the rounds without it).

Rows as in ``celery_throughput.py`` (default ``floor-release`` and ``dlock``), interleaved over
``--rounds`` rounds; figures are medians over rounds.

Run: ``.venv/bin/python benchmarks/worker_cpu.py [--tasks N] [--rounds R] [--strace] [--json]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from _common import machine, pin
from celery_throughput import (
    DEFAULT_QUEUE,
    ROWS,
    Env,
    Worker,
    children,
    consume,
    read_results,
    wait_results,
    warm_up,
)

from celery_dlock.testing import redis_servers

TICK = os.sysconf("SC_CLK_TCK")
GC_KEY = "bench:gc"  # as in _throughput_app


def thread_stats(pid: int) -> dict[int, dict[str, Any]]:
    """tid -> name, user and system seconds, run nanoseconds, context switches, of ``pid``."""
    out: dict[int, dict[str, Any]] = {}
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{base}/schedstat") as f:
                run_ns = int(f.read().split()[0])
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        out[tid] = {
            "name": "main" if tid == pid else name,
            "user": int(fields[11]) / TICK,
            "sys": int(fields[12]) / TICK,
            "run_ns": run_ns,
            "vcs": int(status["voluntary_ctxt_switches"]),
            "nvcs": int(status["nonvoluntary_ctxt_switches"]),
        }
    return out


def snapshot(worker: Worker) -> dict[str, dict[int, dict[str, Any]]]:
    """Per-thread figures of the main process and of every pool child."""
    assert worker.process is not None
    pid = worker.process.pid
    return {
        "parent": thread_stats(pid),
        "children": {t: s for c in children(pid) for t, s in thread_stats(c).items()},
    }


def thread_key(name: str) -> str:
    # Thread names carry a counter ("Thread-3 (target)", "dlock-background_0"): keep the kind.
    name = re.sub(r"_\d+$", "", name)
    return re.sub(r"^Thread-\d+", "Thread", name)


def per_task(before: dict[str, Any], after: dict[str, Any], tasks: int) -> dict[str, Any]:
    """Per-task deltas, summed per role (parent / children) and per thread kind."""
    out: dict[str, Any] = {}
    for role in ("parent", "children"):
        threads: dict[str, dict[str, float]] = collections.defaultdict(
            lambda: {"user_us": 0.0, "sys_us": 0.0, "run_us": 0.0, "vcs": 0.0, "nvcs": 0.0}
        )
        for tid, a in after[role].items():
            b = before[role].get(tid, {"user": 0, "sys": 0, "run_ns": 0, "vcs": 0, "nvcs": 0})
            t = threads[thread_key(a["name"])]
            t["user_us"] += (a["user"] - b["user"]) * 1e6 / tasks
            t["sys_us"] += (a["sys"] - b["sys"]) * 1e6 / tasks
            t["run_us"] += (a["run_ns"] - b["run_ns"]) / 1e3 / tasks
            t["vcs"] += (a["vcs"] - b["vcs"]) / tasks
            t["nvcs"] += (a["nvcs"] - b["nvcs"]) / tasks
        total = {k: sum(t[k] for t in threads.values()) for k in next(iter(threads.values()))}
        out[role] = {"total": total, "threads": dict(threads)}
    return out


# -- strace --------------------------------------------------------------------------------------


def strace_start(pids: Sequence[int], out: Path) -> subprocess.Popen[bytes]:
    """``strace -c -f`` attached to ``pids`` (all their threads); returns once every thread is
    traced (polled, with a deadline)."""
    args = ["strace", "-c", "-f", "-o", str(out)]
    for pid in pids:
        args += ["-p", str(pid)]
    proc = subprocess.Popen(args, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    tids = [(p, t) for p in pids for t in os.listdir(f"/proc/{p}/task")]
    while True:
        traced = 0
        for p, t in tids:
            with open(f"/proc/{p}/task/{t}/status") as f:
                tracer = next(line for line in f if line.startswith("TracerPid:"))
            traced += int(tracer.split()[1]) != 0
        if traced == len(tids):
            return proc
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"strace did not attach to {pids}")
        time.sleep(0.01)


def strace_stop(proc: subprocess.Popen[bytes], out: Path, tasks: int) -> dict[str, float]:
    """Detach strace; its summary as calls per task by system call name."""
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    calls: dict[str, float] = {}
    for line in out.read_text().splitlines():
        parts = line.split()
        # % time, seconds, usecs/call, calls, [errors], syscall
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            calls[parts[-1]] = int(parts[3]) / tasks
    return dict(sorted(calls.items(), key=lambda kv: -kv[1]))


# -- one measurement -------------------------------------------------------------------------


def gc_window(journal: redis.Redis, parent: int, start: float, end: float, tasks: int) -> Any:
    """Collections per task (and ms per 1,000 tasks) per generation, that began in the window."""
    out: dict[str, dict[str, float]] = {}
    for raw in journal.lrange(GC_KEY, 0, -1):
        entry = json.loads(raw)
        role = "parent" if entry["pid"] == parent else "children"
        slot = out.setdefault(role, {})
        for began, gen, secs in entry["gc"]:
            if start <= began <= end:
                slot[f"gen{gen}"] = slot.get(f"gen{gen}", 0.0) + 1 / tasks
                slot[f"gen{gen}_us"] = slot.get(f"gen{gen}_us", 0.0) + secs * 1e6 / tasks
    return out


def server_stats(client: redis.Redis) -> dict[str, Any]:
    """CPU seconds of a redis-server so far, and its calls and microseconds per command."""
    cpu = client.info("cpu")
    stats = client.info("commandstats")
    return {
        "cpu": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        "commands": {
            name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for name, v in stats.items()
        },
    }


def server_delta(before: dict[str, Any], after: dict[str, Any], tasks: int) -> dict[str, Any]:
    commands = {}
    for name, (calls, usec) in after["commands"].items():
        calls0, usec0 = before["commands"].get(name, (0, 0))
        if calls > calls0:
            commands[name] = {"calls": (calls - calls0) / tasks, "usec": (usec - usec0) / tasks}
    return {"cpu_us": (after["cpu"] - before["cpu"]) * 1e6 / tasks, "commands": commands}


def measure_round(
    env: Env, row: str, task_name: str, tasks: int, trace: bool, tmp: Path
) -> dict[str, Any]:
    env.fresh()
    task = env.app.tasks[task_name]
    worker = env.worker(row, "single")
    tracer = None
    try:
        base = env.serial * 1_000_000
        warm_up(env, task, base)
        first = base + env.warmup
        ids = [task.delay(first + i).id for i in range(tasks)]
        if env.broker.llen(DEFAULT_QUEUE) != tasks:
            raise RuntimeError(f"{row}: not every message was queued")
        assert worker.process is not None
        pid = worker.process.pid
        if trace:
            tracer = {
                "parent": (strace_start([pid], tmp / "parent.txt"), tmp / "parent.txt"),
                "children": (strace_start(children(pid), tmp / "kids.txt"), tmp / "kids.txt"),
            }
        lock = env.lock_clients[0]
        before, t0, lock0 = snapshot(worker), time.monotonic(), server_stats(lock)
        consume(env, worker, tasks)
        wait_results(env.backend, tasks, env.timeout * (10 if trace else 1), row)
        t1, after, lock1 = time.monotonic(), snapshot(worker), server_stats(lock)
        syscalls = {
            role: strace_stop(proc, out, tasks) for role, (proc, out) in (tracer or {}).items()
        }
        tracer = None
        metas = read_results(env.backend, ids)
    finally:
        if tracer is not None:
            for proc, _ in tracer.values():
                proc.kill()
        worker.stop()  # the processes report their collections as they exit
    if any(m.get("status") != "SUCCESS" for m in metas):
        raise RuntimeError(f"{row}: not every result is SUCCESS")
    result = per_task(before, after, tasks)
    result["gc"] = gc_window(env.journal, pid, t0, t1, tasks)
    result["syscalls"] = syscalls
    result["lock_server"] = server_delta(lock0, lock1, tasks)
    result["drain_s"] = t1 - t0
    return result


def callgrind_round(env: Env, row: str, task_name: str, tasks: int, tmp: Path) -> dict[str, float]:
    """Instructions per task of a solo worker (one process), the whole worker under
    callgrind (see the module docstring)."""
    env.fresh()
    task = env.app.tasks[task_name]
    env.serial += 1
    settings = {**env.worker_env["single"], "BENCH_WORKER_CPUS": env.worker_cpus}
    worker = Worker({**settings, "PYTHONHASHSEED": "0"}, f"{row}-cg{env.serial}", 1)
    worker.pool = "solo"
    worker.prefix = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.%p"]
    worker.start(env.journal, timeout=900)
    try:
        warm_up(env, task, env.serial * 1_000_000)
        first = env.serial * 1_000_000 + env.warmup
        for i in range(tasks):
            task.delay(first + i)
        assert worker.process is not None
        pid = worker.process.pid
        subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
        consume(env, worker, tasks)
        wait_results(env.backend, tasks, env.timeout * 30, f"callgrind {row}")
        count = counted(pid)
    finally:
        worker.stop()
    return {"solo_k": count / tasks / 1000}


def counted(pid: int) -> int:
    """Instructions callgrind counted in ``pid`` (all its threads) since its counters were
    zeroed, read live (``callgrind_control -e Ir``: one line per thread)."""
    done = subprocess.run(
        ["callgrind_control", "-e", "Ir", str(pid)], check=True, capture_output=True, text=True
    )
    per_thread = re.findall(r"^\s*Th\s+\d+\s+([\d,]+)", done.stdout, re.MULTILINE)
    if not per_thread:
        raise RuntimeError(f"no counts from callgrind_control for {pid}: {done.stdout}")
    return sum(int(n.replace(",", "")) for n in per_thread)


def median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of every number, nested as in one round."""
    first = rounds[0]
    out: dict[str, Any] = {}
    keys = {k for r in rounds for k in r} if isinstance(first, dict) else set()
    for k in keys:
        values = [r[k] for r in rounds if k in r]
        if isinstance(values[0], dict):
            out[k] = median_of(values)
        else:
            # a key missing from a round (a thread, a system call, a generation) counts as 0
            values += [0.0] * (len(rounds) - len(values))
            out[k] = round(statistics.median(values), 2)
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    names = {r[0]: r[1] for r in ROWS}
    all_cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    with redis_servers(2) as servers, tempfile.TemporaryDirectory() as tmp:
        placement = pin(servers, args.pin)
        hub, lock1 = servers
        base = f"redis://127.0.0.1:{hub.port}"
        urls = {
            "BENCH_BROKER": f"{base}/0",
            "BENCH_BACKEND": f"{base}/1",
            "BENCH_JOURNAL": f"{base}/2",
            "BENCH_PEER_URL": lock1.url,
            "BENCH_LOCK_URLS": lock1.url,
        }
        os.environ.update(urls)
        import _throughput_app

        env = Env(
            app=_throughput_app.app,
            broker=redis.Redis.from_url(urls["BENCH_BROKER"]),
            backend=redis.Redis.from_url(urls["BENCH_BACKEND"]),
            journal=redis.Redis.from_url(urls["BENCH_JOURNAL"]),
            lock_clients=[redis.Redis.from_url(lock1.url)],
            server_clients=[],
            worker_env={"single": {**urls, "BENCH_PROBE": "1"}},
            worker_cpus=all_cpus,
            concurrency=args.concurrency,
            warmup=args.warmup,
            timeout=args.timeout,
        )
        rounds: dict[str, list[dict[str, Any]]] = {row: [] for row in args.rows}
        traced: dict[str, dict[str, Any]] = {}
        instructions: dict[str, dict[str, float]] = {}
        for rnd in range(args.rounds):
            for row in args.rows if rnd % 2 == 0 else args.rows[::-1]:
                r = measure_round(env, row, names[row], args.tasks, False, Path(tmp))
                rounds[row].append(r)
                say(args, f"round {rnd + 1} {row}: {summary_line(r)}")
        for row in args.rows if args.callgrind else ():
            instructions[row] = callgrind_round(env, row, names[row], args.callgrind, Path(tmp))
            say(args, f"callgrind {row}: {instructions[row]}")
        if args.strace:
            for row in args.rows:
                traced[row] = measure_round(env, row, names[row], args.tasks, True, Path(tmp))
                say(args, f"strace {row}: {traced[row]['syscalls']}")
    return {
        "machine": machine("celery", "kombu"),
        "settings": {
            "tasks": args.tasks,
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "warmup": args.warmup,
            "pin": placement,
        },
        "rows": {row: median_of(r) for row, r in rounds.items() if r},
        "rounds": rounds,
        "strace": {row: r["syscalls"] for row, r in traced.items()},
        "callgrind": instructions,
    }


def summary_line(r: dict[str, Any]) -> str:
    p, c = r["parent"]["total"], r["children"]["total"]
    return (
        f"parent {p['user_us'] + p['sys_us']:.0f} us (run {p['run_us']:.0f}), children "
        f"{c['user_us'] + c['sys_us']:.0f} us (run {c['run_us']:.0f}; sys {c['sys_us']:.0f}), "
        f"cs {c['vcs']:.2f}+{c['nvcs']:.2f}"
    )


def say(args: argparse.Namespace, line: str) -> None:
    if args.verbose:
        print(line, file=sys.stderr, flush=True)


def print_report(result: dict[str, Any]) -> None:
    s = result["settings"]
    print(
        f"{s['tasks']} tasks per row and round, -P prefork -c {s['concurrency']}, "
        f"{s['rounds']} rounds; medians; per task. {s['pin']}"
    )
    rows = result["rows"]
    for role in ("parent", "children"):
        print(f"\n{role}: thread  " + "  ".join(f"{r:>38}" for r in rows))
        print(
            f"{'':<24}"
            + "  ".join(f"{'user':>7} {'sys':>6} {'run':>7} {'vcs':>6} {'nvcs':>6}" for _ in rows)
        )
        names = sorted({t for r in rows.values() for t in r[role]["threads"]})
        for name in ["total", *names]:
            cells = []
            for r in rows.values():
                t = r[role]["total"] if name == "total" else r[role]["threads"].get(name)
                if t is None:
                    cells.append(f"{'-':>38}")
                    continue
                cells.append(
                    f"{t['user_us']:>7.1f} {t['sys_us']:>6.1f} {t['run_us']:>7.1f} "
                    f"{t['vcs']:>6.3f} {t['nvcs']:>6.3f}"
                )
            print(f"  {name:<22}" + "  ".join(cells))
    print("\nlock Redis: CPU us per task; commands: calls and server us per task")
    for row, r in rows.items():
        ls = r["lock_server"]
        cmds = ", ".join(
            f"{k} {v['calls']:.2f}/{v['usec']:.1f}"
            for k, v in sorted(ls["commands"].items(), key=lambda kv: -kv[1]["usec"])
            if v["calls"] >= 0.01
        )
        print(f"  {row:<14} {ls['cpu_us']:>6.1f}  {cmds}")
    print("\ncyclic GC (collections per task, us per task), by generation")
    for row, r in rows.items():
        for role, g in sorted(r.get("gc", {}).items()):
            print(f"  {row:<14} {role:<9} {g}")
    if result.get("callgrind"):
        print("\nk instructions per task (callgrind, a -P solo worker under it)")
        for row, c in result["callgrind"].items():
            print(f"  {row:<14} {c['solo_k']:8.1f}")
    if result["strace"]:
        print("\nsystem calls per task (strace -c -f; a traced round)")
        for row, roles in result["strace"].items():
            for role, calls in roles.items():
                top = ", ".join(f"{k} {v:.2f}" for k, v in calls.items() if v >= 0.01)
                print(f"  {row:<14} {role:<9} {sum(calls.values()):.2f}: {top}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Worker CPU per task by process and thread.")
    names = [r[0] for r in ROWS if r[2] == "single"]
    parser.add_argument("--rows", nargs="+", default=["floor-release", "dlock"], choices=names)
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per row and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--concurrency", type=int, default=2, help="pool processes")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up tasks per worker")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of each wait")
    parser.add_argument("--pin", choices=("split", "same", "none"), default="split")
    parser.add_argument(
        "--callgrind",
        type=int,
        default=0,
        metavar="N",
        help="one round per row of N tasks, the worker under callgrind: instructions per task",
    )
    parser.add_argument("--strace", action="store_true", help="one more round per row, traced")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    parser.add_argument("--report", metavar="JSON", help="print a saved --json result")
    args = parser.parse_args(argv)
    if args.report:
        print_report(json.loads(Path(args.report).read_text()))
        return 0
    result = measure(args)
    print(json.dumps(result) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        print_report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
