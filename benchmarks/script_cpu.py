"""Server CPU per call of the lock's Lua scripts, against the bare commands a lock could send.

A CPU-bound host pays the lock Redis's CPU per task as well as the worker's (issue 20: the lock
server adds ~75 µs per task). This counts it where little else moves it: one fresh
redis-server, each row's calls pipelined (500 per round trip) on keys of its own, the server's
``used_cpu_user + used_cpu_sys`` (``INFO cpu``) before and after, divided by the calls. The
script rows run through redis-py's ``Script`` (``EVALSHA``), as the acquire does. Rows that
take parts of ``ACQUIRE`` on their own show where its time goes.

    python benchmarks/script_cpu.py [--calls 20000] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import redis

from benchmarks._common import code_version
from celery_dlock.backends.redis import scripts
from celery_dlock.core.holder import head_nonce, value_head
from celery_dlock.testing import RedisServer

#: A value head as a task's acquire writes it (the script appends the fence and "}").
HEAD = value_head("0f8e3c1a-5b7d-4c1e-9a2f-6d3b8e4f1a2c", task="bench.job")
NONCE = head_nonce(HEAD)
TTL_MS, RETENTION_MS, SIGNAL_MS = 60_000, 86_400_000, 5_000

#: Parts of ACQUIRE on their own: (row, Lua source).
PARTS = (
    ("script: return 1", "return 1"),
    ("script: EXISTS", "return redis.call('EXISTS', KEYS[3])"),
    ("script: GET", "return redis.call('GET', KEYS[1])"),
    ("script: TIME", "return redis.call('TIME')"),
    ("script: SET PX", "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1"),
)

Call = Callable[[Any, int], Any]


def rows(client: redis.Redis) -> list[tuple[str, Call]]:
    """Each row's one call on pipeline ``p`` for call number ``i`` (keys of its own)."""

    def keys(row: str, i: int) -> list[str]:
        base = f"{row}:{{{i}}}"
        return [base, f"{base}:fence", f"{base}:void"]

    acquire = client.register_script(scripts.ACQUIRE)
    release = client.register_script(scripts.RELEASE)

    def acquiring(floor: str) -> Call:
        return lambda p, i: acquire(
            keys=keys("lock", i), args=[HEAD, TTL_MS, RETENTION_MS, "", floor], client=p
        )

    def releasing(wake: str) -> Call:
        return lambda p, i: release(
            keys=[keys("lock", i)[0], f"lock:{{{i}}}:signal"],
            args=[HEAD, SIGNAL_MS, wake, NONCE],
            client=p,
        )

    # In this order, on the same keys: each acquire finds the key free (the row before
    # released it), the first with no fence counter yet, the others with one.
    out: list[tuple[str, Call]] = [
        ("SET NX PX", lambda p, i: p.set(f"setnx:{i}", "v", nx=True, px=TTL_MS)),
        ("DEL", lambda p, i: p.delete(f"setnx:{i}")),
        ("ACQUIRE, new counter (TIME)", acquiring("1")),
        ("RELEASE, waking a waiter", releasing("1")),
        ("ACQUIRE, single Redis (TIME every time)", acquiring("1")),
        ("RELEASE, no wake-up", releasing("0")),
        ("ACQUIRE, Redlock node (no TIME)", acquiring("0")),
        ("RELEASE, waking a waiter (again)", releasing("1")),
    ]
    for name, source in PARTS:
        script = client.register_script(source)
        row = name.split(": ")[1].replace(" ", "")
        out.append(
            (name, lambda p, i, s=script, r=row: s(keys=keys(r, i), args=[HEAD, TTL_MS], client=p))
        )
    return out


def server_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def measure(client: redis.Redis, call: Call, calls: int) -> float:
    """Server CPU µs per call of ``call``, ``calls`` times, 500 per round trip."""
    pipe = client.pipeline(transaction=False)
    before = server_cpu(client)
    for i in range(calls):
        call(pipe, i)
        if i % 500 == 499:
            pipe.execute()
    pipe.execute()
    return (server_cpu(client) - before) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per row and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each on a fresh server")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    results: dict[str, list[float]] = {}
    version = ""
    for _ in range(args.rounds):
        server = RedisServer().start()
        try:
            client = redis.Redis.from_url(server.url)
            version = str(client.info("server")["redis_version"])
            for name, call in rows(client):
                results.setdefault(name, []).append(measure(client, call, args.calls))
            client.close()
        finally:
            server.stop()
    medians = {name: statistics.median(values) for name, values in results.items()}
    base = medians["SET NX PX"]
    if args.json:
        report = {
            "redis_version": version,
            "celery_dlock": code_version(),
            "calls": args.calls,
            "rounds": results,
            "median_us": medians,
        }
        print(json.dumps(report, indent=1))
        return
    print(f"redis-server {version}; {args.calls} calls per row, median of {args.rounds} rounds")
    print(f"celery_dlock {code_version()}")
    print(f"{'row':48s} {'µs/call':>8s} {'/ SET NX PX':>12s}")
    for name, value in medians.items():
        print(f"{name:48s} {value:8.2f} {value / base:12.2f}")


if __name__ == "__main__":
    main()
