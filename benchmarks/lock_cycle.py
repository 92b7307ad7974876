"""Cost of one uncontended lock cycle (acquire + release), ours against the raw commands and peers.

Starts six throwaway redis-server processes on 127.0.0.1 (one for the single-instance rows,
five for the Redlock rows) and measures, in one run on those servers:

* ``ping``        a PING round trip with redis-py,
* ``raw``         ``SET key token NX PX ttl`` + a compare-and-delete Lua ``Script`` (one server),
* ``raw-5``       the same two commands on five servers at once: each written to all five
                  connections, then the five replies read — the least any Redlock over five
                  masters costs from one Python thread (two rounds of five concurrent round
                  trips), the floor for ``ours-5`` and ``lock-urls-5``,
* ``scripts-1``   our own acquire and release Lua scripts (fencing counter, void marker, waiter
                  signal) sent bare with redis-py, nothing else: what the server side of our
                  cycle costs; ``scripts-5`` the same on five servers at once (write all, read
                  all): the floor for ``ours-5`` and ``lock-urls-5`` with these scripts,
* ``redis-py``    redis-py's ``Lock``: ``acquire(blocking=False)`` + ``release()``,
* ``pottery-1``   pottery's ``Redlock`` on one master, ``pottery-5`` on five,
* ``redis-lock``  python-redis-lock's ``Lock``: ``acquire(blocking=False)`` + ``release()``,
* ``ours-1``      ``manager.acquire(key, ttl=10, renew=False)`` + ``lease.release()``, one URL:
                  the internal path, without the public wrapper,
* ``ours-1r``     the same with ``renew=True`` (registered with the watchdog while held), which is
                  what ``lock()`` does by default: ``lock-urls-1`` / ``ours-1r`` is the
                  public wrapper's own cost,
* ``ours-5``      the same on five URLs (Redlock),
* ``lock-urls-1`` what users write: ``with celery_dlock.lock([url], key, ttl=10):`` (renewed
                  while held, as by default), ``lock-urls-5`` the same on five URLs,
* ``lock-app-1``  ``with celery_dlock.lock(app, key, ttl=10):`` for a Celery app whose
                  ``dlock_urls`` is the one URL.

``--no-hiredis`` runs everything as if hiredis were not installed (redis-py's Python parser
and packer, and ours), the way a user without the ``[fast]`` extra runs it.

Variants are interleaved: every round runs ``--cycles`` cycles of each, in forward order on
even rounds and reverse order on odd ones, so machine noise falls on all of them alike. Each
cycle is timed on its own; a round yields a mean and a median per variant, and the figures
reported are the median over rounds of those. Per round we also record the CPU time the
benchmark process used (all its threads) and the CPU time the redis-servers used (``INFO cpu``),
per cycle, to show where the time goes. Lock objects of the peers are built once and reused;
ours reuses the shared manager, as ``celery_dlock.lock()`` does.

CPU placement: on a small VM a loopback round trip costs very different amounts depending on
whether client and server share a CPU (a context switch) or not (a cross-CPU wake-up), and the
scheduler flips between the two every few seconds. ``--pin split`` (the default when two or
more CPUs are available) keeps this process on one CPU and the servers on the others, like a
client and servers on different hosts; ``--pin same`` puts everything on one CPU; ``--pin none``
leaves placement to the scheduler.

Then the ratios with a target are timed once more **cycle by cycle in turn** (``A, B, A, B,
...``, the order flipped every other round; ``--pair-cycles`` pairs per round): the rounds
above run each row's 1000 cycles one after another, and this host drifts by more between
two rows' turns (±15 % between rounds of one row) than a wrapper's few per cent. Reported per
pair: the median of the rounds' ratios of medians.

A second, untimed pass checks Redlock releases: after each pottery-5 and ours-5 cycle, plain
clients ask every master whether the lock key still exists (pottery returns from ``release``
once a majority answered; ours waits for every node).

Run: ``.venv/bin/python benchmarks/lock_cycle.py [--cycles N] [--rounds R] [--pair-cycles N]
[--no-hiredis] [--json]``.
"""

from __future__ import annotations

import sys

if "--no-hiredis" in sys.argv:  # before redis-py is imported: it picks its parser on import
    sys.modules["hiredis"] = None  # type: ignore[assignment]

import argparse
import gc
import json
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import redis_lock
from _common import machine, pin
from celery import Celery
from pottery import Redlock

from celery_dlock import lock
from celery_dlock.backends.redis.scripts import ACQUIRE, RELEASE
from celery_dlock.core.registry import manager_for
from celery_dlock.testing import redis_servers

TTL_S = 10
TTL_MS = TTL_S * 1000

#: Compare-and-delete: the release half of the raw cycle.
COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

#: (numerator, denominator, target or None) for the ratios printed after the table.
RATIOS: tuple[tuple[str, str, float | None], ...] = (
    ("lock-urls-1", "raw", 1.10),
    ("lock-urls-1", "ours-1", 1.03),
    ("lock-app-1", "ours-1", 1.03),
    ("lock-urls-1", "ours-1r", 1.03),
    ("lock-app-1", "ours-1r", 1.03),
    ("ours-1r", "ours-1", None),
    ("scripts-5", "scripts-1", None),
    ("lock-urls-5", "scripts-5", None),
    ("lock-urls-1", "scripts-1", None),
    ("scripts-1", "raw", None),
    ("lock-urls-5", "lock-urls-1", 1.6),
    ("ours-1", "raw", 1.10),
    ("ours-5", "ours-1", 1.6),
    ("raw-5", "raw", None),
    ("lock-urls-5", "raw-5", None),
    ("redis-lock", "raw", None),
    ("pottery-5", "pottery-1", None),
    ("ping", "raw", None),
    ("redis-py", "raw", None),
    ("pottery-1", "raw", None),
    ("pottery-5", "raw", None),
    ("ours-5", "raw", None),
)


@dataclass
class Variant:
    """One measured operation and what the rounds recorded for it."""

    name: str
    description: str
    op: Callable[[], None]
    round_means: list[float] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)
    round_client_cpu: list[float] = field(default_factory=list)
    round_server_cpu: list[float] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "mean_us": round(statistics.median(self.round_means), 2),
            "median_us": round(statistics.median(self.round_medians), 2),
            "client_cpu_us": round(statistics.median(self.round_client_cpu), 2),
            "server_cpu_us": round(statistics.median(self.round_server_cpu), 2),
            "round_means_us": [round(x, 2) for x in self.round_means],
            "round_medians_us": [round(x, 2) for x in self.round_medians],
        }


@dataclass
class LeftoverCheck:
    """Counts Redlock cycles after which a copy of the lock key was still on some master."""

    name: str
    op: Callable[[], None]
    key: str
    cycles: int = 0
    left_behind: int = 0
    copies: int = 0


class ServerCpu:
    """CPU seconds the redis-servers have used so far, from ``INFO cpu`` (getrusage)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.clients = [redis.Redis.from_url(u) for u in urls]

    def total(self) -> float:
        seconds = 0.0
        for client in self.clients:
            info = client.info("cpu")
            seconds += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        return seconds


def time_batch(op: Callable[[], None], cycles: int) -> list[float]:
    """Run ``op`` ``cycles`` times; microseconds per call."""
    clock = time.perf_counter_ns
    out: list[float] = []
    append = out.append
    for _ in range(cycles):
        start = clock()
        op()
        append((clock() - start) / 1000.0)
    return out


#: (numerator, denominator, target or None) timed alternately, cycle by cycle.
PAIRS: tuple[tuple[str, str, float | None], ...] = (
    ("lock-urls-1", "ours-1r", 1.03),
    ("lock-app-1", "ours-1r", 1.03),
    ("lock-urls-1", "ours-1", 1.03),
    ("ours-1r", "ours-1", None),
    ("lock-urls-1", "raw", 1.10),
    ("lock-urls-5", "lock-urls-1", 1.6),
    ("scripts-5", "scripts-1", None),
)


def time_in_turn(
    first: Callable[[], None], second: Callable[[], None], pairs: int
) -> tuple[list[float], list[float]]:
    """Run ``first`` and ``second`` one after the other ``pairs`` times; microseconds per call
    of each."""
    clock = time.perf_counter_ns
    out_first: list[float] = []
    out_second: list[float] = []
    for _ in range(pairs):
        start = clock()
        first()
        middle = clock()
        second()
        end = clock()
        out_first.append((middle - start) / 1000.0)
        out_second.append((end - middle) / 1000.0)
    return out_first, out_second


def measure_in_turn(variants: dict[str, Variant], pairs: int, rounds: int) -> dict[str, Any]:
    """Each of :data:`PAIRS` timed in turn: per round the ratio of the two medians."""
    out: dict[str, Any] = {}
    for num, den, target in PAIRS:
        ratios: list[float] = []
        for r in range(rounds):
            gc.collect()
            if r % 2 == 0:
                a, b = time_in_turn(variants[num].op, variants[den].op, pairs)
            else:
                b, a = time_in_turn(variants[den].op, variants[num].op, pairs)
            ratios.append(statistics.median(a) / statistics.median(b))
        paired = statistics.median(ratios)
        out[f"{num}/{den}"] = {
            "paired": round(paired, 3),
            "round_ratios": [round(x, 3) for x in ratios],
            "target": target,
            "met": None if target is None else paired <= target,
        }
    return out


def scripts(urls: Sequence[str], key: str) -> Callable[[], None]:
    """Our ACQUIRE and RELEASE scripts, bare: written to every server, then read."""
    conns = [redis.Redis.from_url(u).connection_pool.get_connection() for u in urls]
    shas = [
        redis.Redis.from_url(urls[0]).script_load(ACQUIRE),
        redis.Redis.from_url(urls[0]).script_load(RELEASE),
    ]
    for u in urls[1:]:
        redis.Redis.from_url(u).script_load(ACQUIRE)
        redis.Redis.from_url(u).script_load(RELEASE)
    lock_key, fence_key, signal_key = f"{key}:l", f"{key}:f", f"{key}:s"

    def cycle() -> None:
        token = secrets.token_urlsafe(15)
        head = f'{{"token":"{token}","holder":null,"fence":'
        void = f"{lock_key}:void:{token}"
        for conn in conns:
            conn.send_command(
                "EVALSHA", shas[0], 3, lock_key, fence_key, void, head, TTL_MS, TTL_MS, "", "0"
            )
        if any(conn.read_response()[0] != 1 for conn in conns):
            raise RuntimeError("scripts: acquire refused: key left over")
        for conn in conns:
            conn.send_command("EVALSHA", shas[1], 2, lock_key, signal_key, head, 1000, "1", token)
        if [conn.read_response() for conn in conns] != [1] * len(conns):
            raise RuntimeError("scripts: release did not delete")

    return cycle


def build_variants(single_url: str, redlock_urls: Sequence[str]) -> list[Variant]:
    def client(url: str) -> redis.Redis:
        return redis.Redis.from_url(url)

    ping_client = client(single_url)

    def ping() -> None:
        ping_client.ping()

    raw_client = client(single_url)
    compare_and_delete = raw_client.register_script(COMPARE_AND_DELETE)

    def raw() -> None:
        token = secrets.token_urlsafe(20)
        if not raw_client.set("bench:raw", token, nx=True, px=TTL_MS):
            raise RuntimeError("raw SET NX failed: key left over")
        if compare_and_delete(keys=["bench:raw"], args=[token]) != 1:
            raise RuntimeError("raw compare-and-delete did not delete")

    fanout = [client(u).connection_pool.get_connection() for u in redlock_urls]
    cad_sha = raw_client.script_load(COMPARE_AND_DELETE)
    for u in redlock_urls:
        client(u).script_load(COMPARE_AND_DELETE)

    def raw5() -> None:
        token = secrets.token_urlsafe(20)
        for conn in fanout:
            conn.send_command("SET", "bench:raw5", token, "NX", "PX", TTL_MS)
        if not all(conn.read_response() for conn in fanout):
            raise RuntimeError("raw-5 SET NX failed: key left over")
        for conn in fanout:
            conn.send_command("EVALSHA", cad_sha, 1, "bench:raw5", token)
        if [conn.read_response() for conn in fanout] != [1] * len(fanout):
            raise RuntimeError("raw-5 compare-and-delete did not delete")

    redispy_lock = client(single_url).lock("bench:redispy", timeout=TTL_S)

    def redispy() -> None:
        if not redispy_lock.acquire(blocking=False):
            raise RuntimeError("redis-py Lock not acquired")
        redispy_lock.release()

    def pottery(masters: list[redis.Redis], key: str) -> Callable[[], None]:
        lock = Redlock(key=key, masters=masters, auto_release_time=TTL_S)

        def cycle() -> None:
            if not lock.acquire(blocking=False):
                raise RuntimeError(f"pottery Redlock {key} not acquired")
            lock.release()

        return cycle

    def ours(urls: Sequence[str], key: str, renew: bool = False) -> Callable[[], None]:
        manager = manager_for(list(urls))

        def cycle() -> None:
            lease = manager.acquire(key, ttl=TTL_S, renew=renew)
            lease.release()

        return cycle

    prl = redis_lock.Lock(client(single_url), "bench:prl", expire=TTL_S)

    def python_redis_lock() -> None:
        if not prl.acquire(blocking=False):
            raise RuntimeError("python-redis-lock not acquired")
        prl.release()

    def public(target: Any, key: str) -> Callable[[], None]:
        def cycle() -> None:
            with lock(target, key, ttl=TTL_S):
                pass

        return cycle

    app = Celery("bench", set_as_current=False)
    app.conf.dlock_urls = [single_url]

    return [
        Variant("ping", "redis-py PING round trip", ping),
        Variant("raw", "SET NX PX + compare-and-delete Script", raw),
        Variant("raw-5", "the same on 5 servers at once (write all, read all)", raw5),
        Variant("scripts-1", "our acquire + release scripts, bare", scripts([single_url], "bs1")),
        Variant("scripts-5", "the same on 5 servers at once", scripts(redlock_urls, "bs5")),
        Variant("redis-py", "redis-py Lock acquire(blocking=False)+release", redispy),
        Variant(
            "pottery-1",
            "pottery Redlock, 1 master",
            pottery([client(single_url)], "bench:pottery1"),
        ),
        Variant(
            "pottery-5",
            "pottery Redlock, 5 masters",
            pottery([client(u) for u in redlock_urls], "bench:pottery5"),
        ),
        Variant("ours-1", "celery_dlock, single Redis", ours([single_url], "bench:ours1")),
        Variant(
            "ours-1r",
            "celery_dlock, single Redis, renew=True",
            ours([single_url], "bench:ours1r", renew=True),
        ),
        Variant("ours-5", "celery_dlock, Redlock over 5", ours(redlock_urls, "bench:ours5")),
        Variant("redis-lock", "python-redis-lock Lock", python_redis_lock),
        Variant(
            "lock-urls-1",
            "with celery_dlock.lock([url], key): single",
            public([single_url], "bench:urls1"),
        ),
        Variant(
            "lock-urls-5",
            "with celery_dlock.lock(urls, key): Redlock over 5",
            public(list(redlock_urls), "bench:urls5"),
        ),
        Variant(
            "lock-app-1", "with celery_dlock.lock(app, key): single", public(app, "bench:app1")
        ),
    ]


def build_checks(redlock_urls: Sequence[str]) -> list[LeftoverCheck]:
    masters = [redis.Redis.from_url(u) for u in redlock_urls]
    lock = Redlock(key="bench:pottery5-check", masters=masters, auto_release_time=TTL_S)

    def pottery_cycle() -> None:
        if not lock.acquire(blocking=False):
            raise RuntimeError("pottery Redlock not acquired in the leftover check")
        lock.release()

    manager = manager_for(list(redlock_urls))

    def ours_cycle() -> None:
        manager.acquire("bench:ours5-check", ttl=TTL_S, renew=False).release()

    return [
        LeftoverCheck("pottery-5", pottery_cycle, "bench:pottery5-check"),
        LeftoverCheck("ours-5", ours_cycle, manager.redis_keys("bench:ours5-check")[0]),
    ]


def run_checks(checks: list[LeftoverCheck], urls: Sequence[str], cycles: int) -> None:
    """Interleave the Redlock cycles; after each, count masters that still hold the key.

    Each master is asked once, one after another, right after ``release`` returned; a copy
    deleted while we ask is missed, so the count is a lower bound.
    """
    plain = [redis.Redis.from_url(u) for u in urls]
    for _ in range(cycles):
        for check in checks:
            check.op()
            copies = sum(int(c.exists(check.key)) for c in plain)
            check.cycles += 1
            check.copies += copies
            if copies:
                check.left_behind += 1
                # Let the straggling delete land (a blocking query per master; at worst the
                # copy expires after the ttl) so that one copy is never counted twice.
                for c in plain:
                    while c.exists(check.key):
                        pass
    for c in plain:
        c.close()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    with redis_servers(6) as servers:
        placement = pin(servers, args.pin)
        single_url = servers[0].url
        redlock_urls = [s.url for s in servers[1:]]
        info = redis.Redis.from_url(single_url).info("server")
        server_cpu = ServerCpu([s.url for s in servers])
        variants = build_variants(single_url, redlock_urls)
        for v in variants:
            time_batch(v.op, args.warmup)
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                gc.collect()  # one variant's garbage is not collected on another's time
                cpu0, srv0 = time.process_time(), server_cpu.total()
                times = time_batch(v.op, args.cycles)
                cpu1, srv1 = time.process_time(), server_cpu.total()
                v.round_means.append(statistics.fmean(times))
                v.round_medians.append(statistics.median(times))
                v.round_client_cpu.append((cpu1 - cpu0) * 1e6 / args.cycles)
                v.round_server_cpu.append((srv1 - srv0) * 1e6 / args.cycles)
        in_turn = (
            measure_in_turn({v.name: v for v in variants}, args.pair_cycles, args.rounds)
            if args.pair_cycles
            else {}
        )
        checks = build_checks(redlock_urls)
        for check in checks:
            check.op()  # scripts loaded, connections open
        run_checks(checks, redlock_urls, args.check_cycles)

    figures = {v.name: v.figures() for v in variants}
    ratios: dict[str, Any] = {}
    for num, den, target in RATIOS:
        by_median = figures[num]["median_us"] / figures[den]["median_us"]
        by_mean = figures[num]["mean_us"] / figures[den]["mean_us"]
        # Per round, num and den ran back to back: the median of those ratios is the least
        # moved by a round that was slow for every variant.
        paired = statistics.median(
            a / b
            for a, b in zip(
                figures[num]["round_medians_us"], figures[den]["round_medians_us"], strict=True
            )
        )
        ratios[f"{num}/{den}"] = {
            "median": round(by_median, 3),
            "mean": round(by_mean, 3),
            "paired": round(paired, 3),
            "target": target,
            "met_median": None if target is None else by_median <= target,
            "met_mean": None if target is None else by_mean <= target,
        }
    return {
        "machine": {**machine("pottery"), "redis-server": info["redis_version"]},
        "settings": {
            "hiredis": not args.no_hiredis,
            "cycles": args.cycles,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "check_cycles": args.check_cycles,
            "pair_cycles": args.pair_cycles,
            "ttl_s": TTL_S,
            "pin": placement,
        },
        "variants": figures,
        "ratios": ratios,
        "in_turn": in_turn,
        "left_behind": {
            c.name: {
                "cycles": c.cycles,
                "cycles_with_copy": c.left_behind,
                "percent": round(100.0 * c.left_behind / max(1, c.cycles), 3),
                "copies_seen": c.copies,
            }
            for c in checks
        },
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def print_report(result: dict[str, Any]) -> None:
    m, s = result["machine"], result["settings"]
    print(
        f"Python {m['python']}, redis-py {m['redis-py']}, "
        f"hiredis {m['hiredis'] if sys.modules.get('hiredis') else 'OFF'}, "
        f"pottery {m['pottery']}, Redis {m['redis-server']}; {m['nproc']} CPU(s): {m['cpu']}"
    )
    print(f"celery_dlock: {m['celery_dlock']}")
    print(f"CPU placement: {s['pin']}")
    print(
        f"{s['rounds']} interleaved rounds x {s['cycles']} cycles per variant "
        f"(after {s['warmup']} warm-up cycles); figures are medians over rounds\n"
    )
    print(
        f"{'variant':<11} {'mean us':>8} {'median us':>10} {'/ raw':>6} "
        f"{'client CPU':>11} {'server CPU':>11}  per-round medians (us)"
    )
    raw = result["variants"]["raw"]["median_us"]
    for name, v in result["variants"].items():
        spread = " ".join(f"{x:.0f}" for x in v["round_medians_us"])
        print(
            f"{name:<11} {v['mean_us']:>8.1f} {v['median_us']:>10.1f} "
            f"{v['median_us'] / raw:>6.2f} {v['client_cpu_us']:>11.1f} "
            f"{v['server_cpu_us']:>11.1f}  {spread}"
        )
    print("\nratios of medians (of means in brackets; paired: median of per-round ratios)")
    for key, r in result["ratios"].items():
        line = f"  {key:<24} {r['median']:>6.3f}  ({r['mean']:.3f})  paired {r['paired']:.3f}"
        if r["target"] is not None:
            line += f"   target <= {r['target']}: {'met' if r['met_median'] else 'MISSED'}"
            if r["met_median"] != r["met_mean"]:
                line += f" (on means: {'met' if r['met_mean'] else 'MISSED'})"
        print(line)
    if result.get("in_turn"):
        print(f"\nratios timed in turn, cycle by cycle ({s['pair_cycles']} pairs per round):")
        for key, r in result["in_turn"].items():
            rounds = " ".join(f"{x:.3f}" for x in r["round_ratios"])
            line = f"  {key:<24} paired {r['paired']:.3f}  ({rounds})"
            if r["target"] is not None:
                line += f"   target <= {r['target']}: {'met' if r['met'] else 'MISSED'}"
            print(line)
    print("\nRedlock release: cycles after which a copy of the key was still on a master")
    for name, c in result["left_behind"].items():
        print(
            f"  {name:<10} {c['cycles_with_copy']:>5} of {c['cycles']} cycles "
            f"({c['percent']:.2f} %), {c['copies_seen']} copies seen"
        )
    print(f"\nelapsed {result['elapsed_s']} s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Cost of one uncontended lock cycle: ours against raw commands and peers."
    )
    parser.add_argument("--cycles", type=int, default=1000, help="cycles per variant per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=300, help="untimed cycles per variant")
    parser.add_argument(
        "--check-cycles",
        type=int,
        default=3000,
        help="untimed Redlock cycles per library checked for copies left behind",
    )
    parser.add_argument(
        "--pair-cycles",
        type=int,
        default=1000,
        help="pairs per round for the ratios timed in turn (0: skip them)",
    )
    parser.add_argument(
        "--pin",
        choices=("split", "same", "none"),
        default="split",
        help="CPU placement of this process and the servers (see the module docstring)",
    )
    parser.add_argument(
        "--no-hiredis", action="store_true", help="run as if hiredis were not installed"
    )
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
