"""Hand-over latency: from the holder's release to the moment a blocked waiter's acquire returns.

For each library a holder holds a key while a waiter blocks on it; the holder records
``time.perf_counter()`` right before calling release, the waiter right after its acquire
returns, and the difference is one hand-over. On Linux ``perf_counter`` reads
``CLOCK_MONOTONIC``, one clock for every process of the machine, so the two readings compare
across threads and processes alike (the script checks this).

Variants, each with its own key, on throwaway redis-servers (one, and five for Redlock):

* ``blpop-floor``  no lock at all: the holder RPUSHes, the waiter's BLPOP returns; the floor
  for any lock whose waiters are woken through BLPOP, on this machine and in this protocol,
* ``wake-acquire-floor``  the least a *correct* BLPOP-woken lock pays: the holder's release is one
  script (compare-and-delete its key, push a wake-up), the woken waiter then confirms with one
  ``SET NX PX`` round trip; the lock takes its lease from that reply, so its validity counts
  from a request it sent (a lease granted inside the holder's release would start at a time
  the waiter cannot bound from its own clock),
* ``ours-1``  ``manager.acquire(key, ttl=10, wait=10)`` on one Redis (waiters block on BLPOP),
* ``ours-5``  the same on five Redis masters (Redlock),
* ``redis-py``  redis-py ``Lock(timeout=10)``, blocking ``acquire()``: polls every 0.1 s (default),
* ``python-redis-lock``  ``redis_lock.Lock(client, name, expire=10).acquire(blocking=True)``.

One hand-over: the holder takes the key, tells the waiter to acquire, and then (with
``--release-at blocked``, the default) watches ``CLIENT LIST`` until the waiter's connection is
really waiting: blocked in BLPOP for ours and python-redis-lock, or past its first refused
``SET NX`` for redis-py. It then keeps the key a random 0..``--hold`` seconds more (so a
polling waiter's phase is random, as in real use), and releases. The waiter releases at once
after acquiring and reports its time; the holder takes the key again for the next one.
``--release-at go`` skips the watching: the holder releases a random 0..``--hold`` seconds
after telling the waiter to go, whatever the waiter is doing by then.

The waiter runs in its own process (``--mode process``, default) or in a thread of the
holder's process (``--mode thread``). Variants are interleaved in rounds. CPU placement as in
``lock_cycle.py`` (``--pin split``: both clients on one CPU, the servers on the others).

Run: ``.venv/bin/python benchmarks/handover.py [--handovers N] [--mode process|thread] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis
import redis_lock
from _common import machine, pin

from celery_dlock.backends.redis.redlock import LockManager
from celery_dlock.core.lease import Lease
from celery_dlock.core.registry import manager_for
from celery_dlock.testing import redis_servers

TTL_S = 10
WAITER = "bench-waiter"
HOLDER = "bench-holder"
#: Longest a step may take before the benchmark gives up (a stuck waiter, a lost lock).
STEP_TIMEOUT = 30.0

VARIANTS = (
    "blpop-floor",
    "wake-acquire-floor",
    "ours-1",
    "ours-5",
    "redis-py",
    "python-redis-lock",
)

Pipe = multiprocessing.connection.Connection


class Side(Protocol):
    """One party of a hand-over: takes the variant's key (blocking) and gives it back."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...


class OursSide:
    def __init__(self, urls: Sequence[str], key: str, name: str) -> None:
        # Named connections, so the holder can see in CLIENT LIST when the waiter blocks.
        named = [f"{url}?client_name={name}" for url in urls]
        self.manager: LockManager = manager_for(named)
        self.key = key
        self.lease: Lease | None = None

    def acquire(self) -> None:
        self.lease = self.manager.acquire(self.key, ttl=TTL_S, wait=10)

    def release(self) -> None:
        assert self.lease is not None, "release before acquire"
        self.lease.release()


class RedisPySide:
    def __init__(self, url: str, key: str, name: str) -> None:
        self.client = redis.Redis.from_url(url, client_name=name)
        self.lock = self.client.lock(key, timeout=TTL_S)  # default sleep: 0.1 s

    def acquire(self) -> None:
        if not self.lock.acquire():
            raise RuntimeError("redis-py Lock: blocking acquire returned False")

    def release(self) -> None:
        self.lock.release()


class RedisLockSide:
    def __init__(self, url: str, key: str, name: str) -> None:
        self.client = redis.Redis.from_url(url, client_name=name)
        self.key = key
        self.lock: Any = None

    def acquire(self) -> None:
        self.lock = redis_lock.Lock(self.client, self.key, expire=TTL_S)
        if not self.lock.acquire(blocking=True):
            raise RuntimeError("python-redis-lock: blocking acquire returned False")

    def release(self) -> None:
        self.lock.release()


class FloorSide:
    """No lock: the holder's "release" pushes to a list the waiter blocks on (BLPOP).

    The least any BLPOP-woken lock can cost on this machine: one wake-up, no acquire after it.
    """

    def __init__(self, url: str, key: str, name: str) -> None:
        self.client = redis.Redis.from_url(url, client_name=name)
        self.key = key
        self.waiter = name == WAITER

    def acquire(self) -> None:
        if self.waiter and not self.client.blpop([self.key], TTL_S):
            raise RuntimeError("blpop-floor: no push within the ttl")

    def release(self) -> None:
        if not self.waiter:
            self.client.rpush(self.key, "1")


class WakeAcquireSide:
    """A minimal correct BLPOP-woken lock: ``SET NX PX`` to take, a script to release and wake.

    No fencing, no renewal, no queue: what is left is one wake-up plus the one round trip that
    gives the waiter a lease it can date. The floor for hand-overs of any lock built that way.
    """

    RELEASE = (
        "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]); "
        "if redis.call('LLEN', KEYS[2]) == 0 then redis.call('RPUSH', KEYS[2], '1') end; "
        "return 1 end; return 0"
    )

    def __init__(self, url: str, key: str, name: str) -> None:
        self.client = redis.Redis.from_url(url, client_name=name)
        self.key, self.signal = key, f"{key}:signal"
        self.nonce = f"{name}-{random.getrandbits(64):x}"
        self.release_script = self.client.register_script(self.RELEASE)

    def acquire(self) -> None:
        give_up = time.monotonic() + TTL_S
        while not self.client.set(self.key, self.nonce, nx=True, px=TTL_S * 1000):
            left = give_up - time.monotonic()
            if left <= 0:
                raise RuntimeError("wake-acquire-floor: not acquired within the ttl")
            self.client.blpop([self.signal], max(1, int(left)))

    def release(self) -> None:
        if not self.release_script(keys=[self.key, self.signal], args=[self.nonce]):
            raise RuntimeError("wake-acquire-floor: released a key it did not hold")


def make_side(variant: str, single: str, five: Sequence[str], name: str) -> Side:
    key = f"bench:handover:{variant}"
    if variant == "blpop-floor":
        return FloorSide(single, key, name)
    if variant == "wake-acquire-floor":
        return WakeAcquireSide(single, key, name)
    if variant == "ours-1":
        return OursSide([single], key, name)
    if variant == "ours-5":
        return OursSide(five, key, name)
    if variant == "redis-py":
        return RedisPySide(single, key, name)
    if variant == "python-redis-lock":
        return RedisLockSide(single, key, name)
    raise ValueError(f"unknown variant {variant!r}")


def waiter_main(conn: Pipe, variant: str, single: str, five: Sequence[str]) -> None:
    """The waiter: on each "go", acquire (blocking), note the time, release, report the time."""
    try:
        side = make_side(variant, single, five, WAITER)
        conn.send(("ready", 0.0))
        while conn.recv() == "go":
            side.acquire()
            acquired = time.perf_counter()
            side.release()
            conn.send(("acquired", acquired))
    except Exception as exc:  # report to the holder rather than leave it waiting
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def receive(conn: Pipe, what: str) -> float:
    if not conn.poll(STEP_TIMEOUT):
        raise RuntimeError(f"waiter did not report {what} within {STEP_TIMEOUT} s")
    kind, value = conn.recv()
    if kind == "error":
        raise RuntimeError(f"waiter failed: {value}")
    if kind != what:
        raise RuntimeError(f"waiter sent {kind!r}, expected {what!r}")
    return float(value)


def waiting_check(variant: str, single: str, five: Sequence[str]) -> Callable[[], bool]:
    """A query that is True once the waiter is waiting (for BLPOP-based ones: blocked)."""
    url = five[0] if variant == "ours-5" else single  # our waiters block on the first node
    monitor = redis.Redis.from_url(url)
    if variant == "redis-py":
        # It polls: waiting once its first SET NX was refused (its previous command was the
        # EVALSHA of its last release, or the connection setup).
        return lambda: any(
            c.get("name") == WAITER and c.get("cmd") == "set" for c in monitor.client_list()
        )
    return lambda: any(
        c.get("name") == WAITER and "b" in str(c.get("flags", "")) for c in monitor.client_list()
    )


@dataclass
class Run:
    """One variant: its waiter and the figures gathered for it."""

    name: str
    holder: Side
    conn: Pipe
    waiting: Callable[[], bool]
    worker: multiprocessing.process.BaseProcess | threading.Thread
    latencies: list[float] = field(default_factory=list)
    #: The latencies of each interleaved round, for per-round medians and paired ratios.
    rounds: list[list[float]] = field(default_factory=list)
    time_to_wait: list[float] = field(default_factory=list)

    def handover(self, release_at: str, hold: float, rng: random.Random, record: bool) -> None:
        self.holder.acquire()
        self.conn.send("go")
        told = time.perf_counter()
        if release_at == "blocked":
            give_up = told + STEP_TIMEOUT
            while not self.waiting():  # each check is a blocking CLIENT LIST round trip
                if time.perf_counter() > give_up:
                    raise RuntimeError(f"{self.name}: waiter never seen waiting")
            seen = time.perf_counter()
            if record:
                self.time_to_wait.append(seen - told)
        time.sleep(rng.uniform(0.0, hold))  # hold time, not synchronisation
        released = time.perf_counter()
        self.holder.release()
        acquired = receive(self.conn, "acquired")
        if record:
            self.latencies.append(acquired - released)
            self.rounds[-1].append(acquired - released)

    def stop(self) -> None:
        self.conn.send("stop")
        self.worker.join(STEP_TIMEOUT)
        self.conn.close()


def start_run(variant: str, mode: str, single: str, five: Sequence[str]) -> Run:
    ours, theirs = multiprocessing.Pipe()
    worker: multiprocessing.process.BaseProcess | threading.Thread
    if mode == "process":
        ctx = multiprocessing.get_context("spawn")
        worker = ctx.Process(target=waiter_main, args=(theirs, variant, single, list(five)))
    else:
        worker = threading.Thread(
            target=waiter_main, args=(theirs, variant, single, list(five)), daemon=True
        )
    worker.start()
    receive(ours, "ready")
    holder = make_side(variant, single, five, HOLDER)
    return Run(variant, holder, ours, waiting_check(variant, single, five), worker)


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Milliseconds: median, p90, mean, min, max."""
    if not samples:
        return {}
    ms = sorted(x * 1000.0 for x in samples)
    p90 = ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))]
    return {
        "median_ms": round(statistics.median(ms), 3),
        "p90_ms": round(p90, 3),
        "mean_ms": round(statistics.fmean(ms), 3),
        "min_ms": round(ms[0], 3),
        "max_ms": round(ms[-1], 3),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    clock = time.get_clock_info("perf_counter").implementation
    if args.mode == "process" and "CLOCK_MONOTONIC" not in clock:
        raise SystemExit(f"perf_counter is {clock}: not comparable across processes here")
    started = time.monotonic()
    rng = random.Random(args.seed)
    per_round = max(1, args.handovers // args.rounds)
    with redis_servers(6) as servers:
        placement = pin(servers, args.pin)
        single, five = servers[0].url, [s.url for s in servers[1:]]
        server_version = redis.Redis.from_url(single).info("server")["redis_version"]
        runs = [start_run(v, args.mode, single, five) for v in args.variants]
        try:
            for run in runs:
                for _ in range(args.warmup):
                    run.handover(args.release_at, args.hold, rng, record=False)
            for r in range(args.rounds):
                for run in runs if r % 2 == 0 else runs[::-1]:
                    run.rounds.append([])
                    for _ in range(per_round):
                        run.handover(args.release_at, args.hold, rng, record=True)
        finally:
            for run in runs:
                run.stop()
    return {
        "machine": {
            **machine("python-redis-lock"),
            "clock": clock,
            "redis-server": server_version,
        },
        "settings": {
            "mode": args.mode,
            "release_at": args.release_at,
            "handovers": per_round * args.rounds,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "hold_max_s": args.hold,
            "pin": placement,
            "seed": args.seed,
        },
        "variants": {
            run.name: {
                "handover": summary(run.latencies),
                "time_to_wait": summary(run.time_to_wait),
                "round_medians_ms": [
                    round(statistics.median(r) * 1000.0, 3) for r in run.rounds if r
                ],
                "handovers": len(run.latencies),
            }
            for run in runs
        },
        "target_median_ms": 0.5,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def paired(mine: Sequence[float], base: Sequence[float]) -> float:
    """The median of per-round ratios (rounds are interleaved, so each pair shares its moment)."""
    return statistics.median(a / b for a, b in zip(mine, base, strict=True))


def ratios(variants: dict[str, Any]) -> None:
    """Our rows against the two floors: ratio of the per-round medians' medians, and paired."""
    floors = [f for f in ("blpop-floor", "wake-acquire-floor") if f in variants]
    lines = []
    for name in ("ours-1", "ours-5", "python-redis-lock"):
        for floor in floors:
            if name in variants:
                mine, base = variants[name]["round_medians_ms"], variants[floor]["round_medians_ms"]
                whole = statistics.median(mine) / statistics.median(base)
                lines.append(f"  {name}/{floor}: {whole:.3f} (paired {paired(mine, base):.3f})")
    if lines:
        print("\nper-round medians, ratio of medians (paired: median of per-round ratios):")
        print("\n".join(lines))


def print_report(result: dict[str, Any]) -> None:
    m, s = result["machine"], result["settings"]
    print(
        f"Python {m['python']}, redis-py {m['redis-py']}, hiredis {m['hiredis']}, "
        f"python-redis-lock {m['python-redis-lock']}, Redis {m['redis-server']}; "
        f"{m['nproc']} CPU(s): {m['cpu']}; clock {m['clock']}"
    )
    print(f"celery_dlock: {m['celery_dlock']}")
    print(
        f"waiter in a {s['mode']}; release when the waiter is "
        f"{'seen waiting' if s['release_at'] == 'blocked' else 'told to go'}, plus a random "
        f"0..{s['hold_max_s'] * 1000:g} ms; {s['handovers']} hand-overs per variant in "
        f"{s['rounds']} interleaved rounds; CPU placement: {s['pin']}\n"
    )
    print(
        f"{'variant':<18} {'median ms':>9} {'p90 ms':>8} {'mean ms':>8} {'min ms':>7} "
        f"{'max ms':>8}   {'to wait (median)':>16}"
    )
    target = result["target_median_ms"]
    for name, v in result["variants"].items():
        h, w = v["handover"], v["time_to_wait"]
        to_wait = f"{w['median_ms']:.2f} ms" if w else "-"
        verdict = ""
        if name.startswith("ours"):
            met = h["median_ms"] <= target
            verdict = f"   target median <= {target} ms: {'met' if met else 'MISSED'}"
        print(
            f"{name:<18} {h['median_ms']:>9.3f} {h['p90_ms']:>8.3f} {h['mean_ms']:>8.3f} "
            f"{h['min_ms']:>7.3f} {h['max_ms']:>8.3f}   {to_wait:>16}{verdict}"
        )
    ratios(result["variants"])
    print(
        "\n'to wait': from telling the waiter to go until CLIENT LIST shows it waiting "
        "(polled, so a bound from above)"
    )
    print(f"elapsed {result['elapsed_s']} s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Hand-over latency: release to the next waiter's acquire."
    )
    parser.add_argument("--handovers", type=int, default=200, help="per variant")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=5, help="unrecorded hand-overs per variant")
    parser.add_argument("--mode", choices=("process", "thread"), default="process")
    parser.add_argument("--release-at", choices=("blocked", "go"), default="blocked")
    parser.add_argument(
        "--hold", type=float, default=0.1, help="max extra hold in seconds (random 0..hold)"
    )
    parser.add_argument("--pin", choices=("split", "same", "none"), default="split")
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), metavar="VARIANT"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
