"""What a lock costs the shared lock server and a long-lived process as work grows (issue 34).

Machine-independent measures first: commands and bytes are counted by the server itself
(``INFO commandstats``: every command, those a Lua script calls included; ``INFO stats``:
``total_net_input_bytes`` + ``total_net_output_bytes``), server CPU from ``INFO cpu``
(``used_cpu_user + used_cpu_sys``, getrusage of the server process), all as deltas around the
measured work, with the cost of the ``INFO`` calls themselves measured with nothing in between
and taken off. On a loaded host the CPU figures move by some per cent between runs; the
counts do not move at all.

Sections (``--sections``, all by default):

* ``cycle``: one Redis, an uncontended acquire + release per cycle on a fresh key each time,
  then on the same keys again (their fence counters now exist), and, on one hot key held by
  someone else, a refused attempt (``wait=0``), at 1 / 4 / 16 / 64
  client threads: ``raw`` (``SET NX PX`` + compare-and-delete, the floor), ``fenced`` (the
  same plus a fence ``INCR`` in one pipeline: the least a fenced lock sends), ``ours``
  (``LockManager.acquire`` + ``release``), redis-py ``Lock``, python-redis-lock, pottery
  ``Redlock`` on one master;
* ``redlock``: the same cycle over 3 and 5 masters, ours against pottery
  (``--redlock-rounds R``: R interleaved rounds, the order turned each round, and the median
  of the per-round CPU ratios);
* ``renew``: one process holding 10 / 100 / 1,000 / 10,000 leases renews them once: server
  commands, bytes and CPU per lease, and the longest single server call (``SLOWLOG``, with a
  threshold of 100 µs: a call shown as 0 took less); beside it the peers' per-lock extend
  loop;
* ``wait``: N threads wait on one key whose holder renews it: server connections per waiter
  (``INFO clients``) and commands per second per waiter over a few ttls;
* ``left``: keys and bytes (``MEMORY USAGE``) left in Redis per distinct key after
  lock-and-release, right after, and a day later: a key whose ``PTTL`` is at most 86,400,000
  ms is gone by then, one without a ttl never is (no clock is faked: the ttl is the server's).

kazoo (ZooKeeper) has no Redis to measure and renews nothing per lock (one session
heartbeat), so it is not in these tables; ``zk_cycle.py`` compares our ZooKeeper backend with
it.

    .venv/bin/python benchmarks/scale.py [--sections cycle redlock renew wait left]
        [--cycles 2000] [--clients 1 4 16 64] [--leases 10 100 1000 10000] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis
import redis_lock
from _common import code_version, machine
from pottery import Redlock

from celery_dlock.core.errors import LockContended
from celery_dlock.core.registry import manager_for
from celery_dlock.testing import redis_servers

logging.getLogger("redis_lock").setLevel(logging.ERROR)  # a warning per refused attempt

TTL_S = 10
TTL_MS = TTL_S * 1000
DAY_MS = 86_400_000
#: The slow log's threshold: a longest call below it is reported as 0.
SLOW_US = 100

COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Probe:
    """Deltas of the servers' own counters (commands, bytes, CPU) around a piece of work,
    less what the probe's ``INFO`` calls cost (measured with nothing in between)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.clients = [redis.Redis.from_url(u) for u in urls]
        base = self._raw_delta(self.snapshot(), self.snapshot())
        self.overhead = base

    def snapshot(self) -> list[dict[str, Any]]:
        return [c.info("all") for c in self.clients]

    @staticmethod
    def _raw_delta(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, float]:
        out = {"commands": 0.0, "bytes": 0.0, "cpu_us": 0.0, "scripts": 0.0}
        for x, y in zip(a, b, strict=True):
            for name, stat in y.items():
                if name.startswith("cmdstat_"):
                    before = x.get(name, {}).get("calls", 0)
                    out["commands"] += stat["calls"] - before
            out["bytes"] += (y["total_net_input_bytes"] - x["total_net_input_bytes"]) + (
                y["total_net_output_bytes"] - x["total_net_output_bytes"]
            )
            out["cpu_us"] += 1e6 * (
                float(y["used_cpu_user"])
                + float(y["used_cpu_sys"])
                - float(x["used_cpu_user"])
                - float(x["used_cpu_sys"])
            )
            # Requests the clients sent: scripts and the commands no script ran.
            for name in ("cmdstat_eval", "cmdstat_evalsha"):
                out["scripts"] += y.get(name, {}).get("calls", 0) - x.get(name, {}).get("calls", 0)
        return out

    def measure(self, work: Callable[[], Any], per: float) -> dict[str, Any]:
        before = self.snapshot()
        work()
        delta = self._raw_delta(before, self.snapshot())
        return {
            k: round(max(0.0, v - self.overhead[k] if k != "cpu_us" else v) / per, 2)
            for k, v in delta.items()
        }


def threaded(clients: int, body: Callable[[int], Any]) -> Callable[[], None]:
    """Run ``body(thread index)`` on ``clients`` threads at once."""

    def run() -> None:
        errors: list[BaseException] = []

        def target(t: int) -> None:
            try:
                body(t)
            except BaseException as exc:  # reported below, not lost in the thread
                errors.append(exc)

        threads = [threading.Thread(target=target, args=(t,)) for t in range(clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]

    return run


# -- one lock cycle per library: (cycle on key, refused attempt on key, hold key) ----------


class Lib:
    """A library's cycle, refused attempt and holding, on keys named by the caller."""

    name = ""

    def cycle(self, key: str) -> None:
        raise NotImplementedError

    def refuse(self, key: str) -> None:
        raise NotImplementedError

    def hold(self, key: str) -> Callable[[], Any]:
        """Take ``key``; the returned callable releases it."""
        raise NotImplementedError


class Raw(Lib):
    name = "raw"

    def __init__(self, urls: Sequence[str]) -> None:
        self.client = redis.Redis.from_url(urls[0])
        self.cad = self.client.register_script(COMPARE_AND_DELETE)

    def cycle(self, key: str) -> None:
        token = secrets.token_urlsafe(15)
        if not self.client.set(key, token, nx=True, px=TTL_MS):
            raise RuntimeError("raw: key taken")
        self.cad(keys=[key], args=[token])

    def refuse(self, key: str) -> None:
        if self.client.set(key, secrets.token_urlsafe(15), nx=True, px=TTL_MS):
            raise RuntimeError("raw: hot key was free")

    def hold(self, key: str) -> Callable[[], Any]:
        self.client.set(key, "holder", px=600_000)
        return lambda: self.client.delete(key)


class Fenced(Raw):
    """``SET NX PX`` and a fence ``INCR`` in one pipeline, compare-and-delete release."""

    name = "fenced"

    def cycle(self, key: str) -> None:
        token = secrets.token_urlsafe(15)
        pipe = self.client.pipeline(transaction=False)
        pipe.set(key, token, nx=True, px=TTL_MS)
        pipe.incr(key + ":fence")
        if not pipe.execute()[0]:
            raise RuntimeError("fenced: key taken")
        self.cad(keys=[key], args=[token])


class Ours(Lib):
    def __init__(self, urls: Sequence[str]) -> None:
        self.name = "ours" if len(urls) == 1 else f"ours-{len(urls)}"
        self.manager = manager_for(list(urls))

    def cycle(self, key: str) -> None:
        self.manager.acquire(key, ttl=TTL_S, renew=False).release()

    def refuse(self, key: str) -> None:
        try:
            self.manager.acquire(key, ttl=TTL_S, renew=False)
        except LockContended:
            return
        raise RuntimeError("ours: hot key was free")

    def hold(self, key: str) -> Callable[[], Any]:
        lease = self.manager.acquire(key, ttl=600, renew=False)
        return lease.release


class RedisPy(Lib):
    name = "redis-py"

    def __init__(self, urls: Sequence[str]) -> None:
        self.client = redis.Redis.from_url(urls[0])

    def cycle(self, key: str) -> None:
        lock = self.client.lock(key, timeout=TTL_S)
        if not lock.acquire(blocking=False):
            raise RuntimeError("redis-py: key taken")
        lock.release()

    def refuse(self, key: str) -> None:
        if self.client.lock(key, timeout=TTL_S).acquire(blocking=False):
            raise RuntimeError("redis-py: hot key was free")

    def hold(self, key: str) -> Callable[[], Any]:
        lock = self.client.lock(key, timeout=600)
        lock.acquire(blocking=False)
        return lock.release


class PythonRedisLock(Lib):
    name = "python-redis-lock"

    def __init__(self, urls: Sequence[str]) -> None:
        self.client = redis.Redis.from_url(urls[0])

    def cycle(self, key: str) -> None:
        lock = redis_lock.Lock(self.client, key, expire=TTL_S)
        if not lock.acquire(blocking=False):
            raise RuntimeError("python-redis-lock: key taken")
        lock.release()

    def refuse(self, key: str) -> None:
        if redis_lock.Lock(self.client, key, expire=TTL_S).acquire(blocking=False):
            raise RuntimeError("python-redis-lock: hot key was free")

    def hold(self, key: str) -> Callable[[], Any]:
        lock = redis_lock.Lock(self.client, key, expire=600)
        lock.acquire(blocking=False)
        return lock.release


class Pottery(Lib):
    def __init__(self, urls: Sequence[str]) -> None:
        self.name = "pottery" if len(urls) == 1 else f"pottery-{len(urls)}"
        self.masters = [redis.Redis.from_url(u) for u in urls]

    def cycle(self, key: str) -> None:
        lock = Redlock(key=key, masters=self.masters, auto_release_time=TTL_S)
        if not lock.acquire(blocking=False):
            raise RuntimeError("pottery: key taken")
        lock.release()

    def refuse(self, key: str) -> None:
        lock = Redlock(key=key, masters=self.masters, auto_release_time=TTL_S)
        if lock.acquire(blocking=False):
            raise RuntimeError("pottery: hot key was free")

    def hold(self, key: str) -> Callable[[], Any]:
        lock = Redlock(key=key, masters=self.masters, auto_release_time=600)
        lock.acquire(blocking=False)
        return lock.release


def warm(lib: Lib, clients: int) -> None:
    """Scripts loaded and each thread's connections open before anything is counted."""

    def body(t: int) -> None:
        lib.cycle(f"warm:{lib.name}:{uuid.uuid4().hex}")

    threaded(clients, body)()


def section_cycle(
    urls: Sequence[str], libs: Sequence[Lib], clients_list: Sequence[int], cycles: int
) -> dict[str, Any]:
    probe = Probe(urls)
    out: dict[str, Any] = {}
    for lib in libs:
        for clients in clients_list:
            warm(lib, clients)
            per = max(1, cycles // clients)
            run = uuid.uuid4().hex[:8]

            def fresh(t: int, lib: Lib = lib, per: int = per, run: str = run) -> None:
                for i in range(per):
                    lib.cycle(f"scale:{run}:{t}:{i}")

            hot = f"hot:{lib.name}:{run}"

            def refused(t: int, lib: Lib = lib, per: int = per, hot: str = hot) -> None:
                for _ in range(per):
                    lib.refuse(hot)

            cell = {"fresh": probe.measure(threaded(clients, fresh), per * clients)}
            # The same keys again: each has its fence counter now (kept a day), as a key a
            # deployment locks over and over (a task name, a resource) has.
            cell["reused"] = probe.measure(threaded(clients, fresh), per * clients)
            free = lib.hold(hot)
            try:
                cell["refused"] = probe.measure(threaded(clients, refused), per * clients)
            finally:
                free()
            out[f"{lib.name}@{clients}"] = cell
            print(f"  {lib.name:18s} {clients:3d} clients  {cell}", file=sys.stderr)
    return out


# -- renewal --------------------------------------------------------------------------------


def slowlog_max(client: redis.Redis) -> tuple[int, int, str]:
    """(entries, longest µs, its command) in the slow log."""
    entries = [
        e
        for e in client.slowlog_get(1_000_000)
        if bytes(e["command"]).split(b" ", 1)[0].upper() not in {b"SLOWLOG", b"INFO", b"CONFIG"}
    ]
    if not entries:
        return 0, 0, ""
    top = max(entries, key=lambda e: e["duration"])
    command = top["command"]
    shown = command[:60].decode(errors="replace") if isinstance(command, bytes) else str(command)
    return len(entries), int(top["duration"]), shown


def section_renew(url: str, counts: Sequence[int]) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    # 100 µs, not 0: at 0 the log also takes an entry for every command a script runs, which
    # slows the script it measures (10,000 leases: 97 ms became 311 ms).
    client.config_set("slowlog-log-slower-than", SLOW_US)
    client.config_set("slowlog-max-len", 200_000)
    probe = Probe([url])
    manager = manager_for([url])
    out: dict[str, Any] = {}
    for n in counts:
        run = uuid.uuid4().hex[:8]
        leases = [manager.acquire(f"renew:{run}:{i}", ttl=60, renew=False) for i in range(n)]
        client.slowlog_reset()
        fig = probe.measure(lambda leases=leases: manager.renew(leases), n)
        logged, longest, what = slowlog_max(client)
        # The probe's own INFO calls and SLOWLOG RESET are left out of the longest call.
        fig.update(longest_call_us=longest, longest_call=what, slow_calls=logged)
        out[f"ours@{n}"] = fig
        for lease in leases:
            lease.release()
        peers: dict[str, Callable[[], Any]] = {}
        rp = [client.lock(f"rp:{run}:{i}", timeout=60) for i in range(n)]
        for lock in rp:
            lock.acquire(blocking=False)
        peers["redis-py"] = lambda rp=rp: [lock.reacquire() for lock in rp]
        prl = [redis_lock.Lock(client, f"prl:{run}:{i}", expire=60) for i in range(n)]
        for lock in prl:
            lock.acquire(blocking=False)
        peers["python-redis-lock"] = lambda prl=prl: [lock.extend() for lock in prl]
        if n <= 1000:  # pottery's extend runs a thread pool per call: 10,000 take too long
            pot = [
                Redlock(key=f"pot:{run}:{i}", masters=[client], auto_release_time=60)
                for i in range(n)
            ]
            for lock in pot:
                lock.acquire(blocking=False)
            peers["pottery"] = lambda pot=pot: [lock.extend() for lock in pot]
        for name, work in peers.items():
            client.slowlog_reset()
            fig = probe.measure(work, n)
            logged, longest, what = slowlog_max(client)
            fig.update(longest_call_us=longest, longest_call=what, slow_calls=logged)
            out[f"{name}@{n}"] = fig
        print(f"  renew {n}: {out[f'ours@{n}']}", file=sys.stderr)
        client.flushdb()
    client.config_set("slowlog-log-slower-than", 10_000)
    return out


# -- waiting --------------------------------------------------------------------------------


def _contend(
    lib: str, url: str, key: str, ttl: float
) -> tuple[Callable[[], Any], Callable[[], None]]:
    """Take ``key`` with ``lib``, renewed while held: (release it, one waiter's body)."""
    client = redis.Redis.from_url(url)
    if lib == "ours":
        manager = manager_for([url])
        lease = manager.acquire(key, ttl=ttl, renew=True)

        def ours() -> None:
            manager.acquire(key, ttl=ttl, wait=None, renew=False).release()

        return lease.release, ours
    if lib == "python-redis-lock":
        holder = redis_lock.Lock(client, key, expire=int(ttl), auto_renewal=True)
        holder.acquire()

        def prl() -> None:
            lock = redis_lock.Lock(redis.Redis.from_url(url), key, expire=int(ttl))
            lock.acquire()
            lock.release()

        return holder.release, prl
    held = client.lock(key, timeout=ttl, thread_local=False)
    held.acquire()
    stop = threading.Event()

    def renewing() -> None:
        while not stop.wait(ttl / 3):
            held.reacquire()

    threading.Thread(target=renewing, daemon=True).start()

    def free() -> None:
        stop.set()
        held.release()

    def redispy() -> None:
        lock = redis.Redis.from_url(url).lock(key, timeout=ttl)
        lock.acquire(blocking=True)
        lock.release()

    return free, redispy


WAIT_LIBS = ("ours", "python-redis-lock", "redis-py")


def section_wait(
    url: str,
    waiters_list: Sequence[int],
    ttl: float,
    libs: Sequence[str] = WAIT_LIBS,
    window: float | None = None,
) -> dict[str, Any]:
    """N threads wait on a key whose holder renews it; connections and traffic per waiter,
    over ``window`` seconds (two ttls by default; ours sets its waiter marker again about
    every tenth look, so a window of ten ttls or more counts that too)."""
    client = redis.Redis.from_url(url)
    out: dict[str, Any] = {}
    window = window or 2 * ttl

    def connected() -> int:
        return int(client.info("clients")["connected_clients"])

    for n in waiters_list:
        for lib in libs:
            free, waiter = _contend(lib, url, f"wait:{lib}:{uuid.uuid4().hex[:8]}", ttl)
            # The holder's own renewals, measured first with nobody waiting, are taken off.
            probe = Probe([url])
            alone = probe.measure(lambda: time.sleep(window), window * n)
            base = connected()
            threads = [threading.Thread(target=waiter, daemon=True) for _ in range(n)]
            for th in threads:
                th.start()
            time.sleep(ttl / 3)  # every waiter refused once and blocked; the holder renews
            conns = connected() - base
            fig = probe.measure(lambda: time.sleep(window), window * n)
            fig = {k: round(v - alone[k], 3) for k, v in fig.items()}
            free()
            for th in threads:
                th.join(ttl * 3)
            out[f"{lib}@{n}"] = {
                "window_s": window,
                "connections_per_waiter": round(conns / n, 2),
                "commands_per_s_per_waiter": fig["commands"],
                "scripts_per_s_per_waiter": fig["scripts"],
                "bytes_per_s_per_waiter": fig["bytes"],
            }
            print(f"  wait {lib} {n}: {out[f'{lib}@{n}']}", file=sys.stderr)
    return out


# -- left behind ------------------------------------------------------------------------------


def section_left(url: str, keys: int) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    out: dict[str, Any] = {}
    libs: list[Lib] = [Raw([url]), Ours([url]), RedisPy([url]), PythonRedisLock([url]),
                       Pottery([url])]  # fmt: skip
    for lib in libs:
        client.flushdb()
        for i in range(keys):
            lib.cycle(f"left:{i}")
        names = list(client.scan_iter(count=1000))
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.pttl(name)
            pipe.memory_usage(name)
        got = pipe.execute()
        pttls, sizes = got[0::2], got[1::2]
        later = [s for p, s in zip(pttls, sizes, strict=True) if p == -1 or p > DAY_MS]
        out[lib.name] = {
            "keys_per_key": round(len(names) / keys, 3),
            "bytes_per_key": round(sum(s or 0 for s in sizes) / keys, 1),
            "longest_pttl_s": round(max(pttls, default=0) / 1000, 1),
            "keys_per_key_a_day_later": round(len(later) / keys, 3),
            "bytes_per_key_a_day_later": round(sum(s or 0 for s in later) / keys, 1),
        }
        print(f"  left {lib.name}: {out[lib.name]}", file=sys.stderr)
    client.flushdb()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["cycle", "redlock", "renew", "wait", "left"],
        choices=["cycle", "redlock", "renew", "wait", "left"],
    )
    parser.add_argument("--cycles", type=int, default=2000, help="cycles per cell")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--leases", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--waiters", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--wait-ttl", type=float, default=3.0, help="the holder's ttl (s)")
    parser.add_argument("--wait-libs", nargs="+", default=list(WAIT_LIBS), choices=WAIT_LIBS)
    parser.add_argument(
        "--wait-window", type=float, default=None, help="seconds measured (default 2 ttls)"
    )
    parser.add_argument("--left-keys", type=int, default=1000)
    parser.add_argument(
        "--redlock-rounds", type=int, default=1, help="interleaved rounds of the redlock section"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    started = time.monotonic()
    result: dict[str, Any] = {}
    with redis_servers(6) as servers:
        one = servers[0].url
        five = [s.url for s in servers[1:]]
        info = redis.Redis.from_url(one).info("server")
        result["machine"] = {**machine("pottery", "python-redis-lock"),
                             "redis-server": info["redis_version"]}  # fmt: skip
        if "cycle" in args.sections:
            libs = [Raw([one]), Fenced([one]), Ours([one]), RedisPy([one]),
                    PythonRedisLock([one]), Pottery([one])]  # fmt: skip
            result["cycle"] = section_cycle([one], libs, args.clients, args.cycles)
        if "redlock" in args.sections:
            result["redlock"] = {}
            rounds: list[dict[str, Any]] = []
            for r in range(args.redlock_rounds):
                cells: dict[str, Any] = {}
                for n in (3, 5):
                    urls = five[:n]
                    libs: list[Lib] = [Ours(urls), Pottery(urls)]
                    # Interleaved, the order turned every round: the host's drift falls on both.
                    cells.update(section_cycle(urls, libs[:: 1 if r % 2 == 0 else -1], [1, 16],
                                               args.cycles // 2))  # fmt: skip
                rounds.append(cells)
            result["redlock"] = rounds[0]
            if len(rounds) > 1:
                result["redlock_rounds"] = rounds
        if "renew" in args.sections:
            result["renew"] = section_renew(one, args.leases)
        if "wait" in args.sections:
            result["wait"] = section_wait(
                one, args.waiters, args.wait_ttl, args.wait_libs, args.wait_window
            )
        if "left" in args.sections:
            result["left"] = section_left(one, args.left_keys)
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    result["celery_dlock"] = code_version()
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return 0


def print_report(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(f"redis-server {m['redis-server']}, redis-py {m['redis-py']}, pottery {m['pottery']}, "
          f"python-redis-lock {m['python-redis-lock']}; {m['nproc']} CPU(s)")  # fmt: skip
    print(f"celery_dlock {result['celery_dlock']}")
    for section in ("cycle", "redlock"):
        if section not in result:
            continue
        print(f"\n[{section}] per cycle (fresh keys | the same keys again) / per refused "
              "attempt (one hot key)")  # fmt: skip
        print(f"{'library@clients':24s}" + f"   {'cmds':>6s} {'scrpt':>5s} {'bytes':>7s} "
              f"{'CPU µs':>7s}" * 3)  # fmt: skip
        for name, cell in result[section].items():
            line = f"{name:24s}"
            for kind in ("fresh", "reused", "refused"):
                f = cell.get(kind)
                line += "   " + ("(not run)".rjust(29) if f is None else
                                 f"{f['commands']:6.2f} {f['scripts']:5.2f} {f['bytes']:7.0f} "
                                 f"{f['cpu_us']:7.1f}")  # fmt: skip
            print(line)
    if "redlock_rounds" in result:
        print("\n[redlock] server CPU per cycle, ours / pottery, per round (median)")
        for cell in sorted(result["redlock_rounds"][0]):
            if not cell.startswith("ours"):
                continue
            peer = cell.replace("ours", "pottery")
            for kind in ("fresh", "reused", "refused"):
                ratios = [r[cell][kind]["cpu_us"] / r[peer][kind]["cpu_us"]
                          for r in result["redlock_rounds"]]  # fmt: skip
                shown = " ".join(f"{x:.2f}" for x in ratios)
                print(f"  {cell:10s} {kind:8s} {statistics.median(ratios):.3f}  ({shown})")
    if "renew" in result:
        print("\n[renew] one renewal of N leases held by one process, per lease; longest call")
        for name, f in result["renew"].items():
            print(f"{name:24s} cmds {f['commands']:6.2f} scripts {f['scripts']:6.3f} "
                  f"bytes {f['bytes']:6.0f} CPU {f['cpu_us']:6.2f} µs  longest "
                  f"{f['longest_call_us']:>7d} µs ({f['longest_call'][:20]})")  # fmt: skip
    if "wait" in result:
        print("\n[wait] per waiting thread, while the holder renews")
        for name, f in result["wait"].items():
            print(f"{name:24s} connections {f['connections_per_waiter']:5.2f}  commands/s "
                  f"{f['commands_per_s_per_waiter']:6.3f}  scripts/s "
                  f"{f['scripts_per_s_per_waiter']:6.3f}  bytes/s "
                  f"{f['bytes_per_s_per_waiter']:7.1f}")  # fmt: skip
    if "left" in result:
        print("\n[left] per distinct key locked and released: right after | a day later")
        for name, f in result["left"].items():
            print(f"{name:24s} keys {f['keys_per_key']:5.2f} bytes {f['bytes_per_key']:6.1f} "
                  f"(longest ttl {f['longest_pttl_s']:.0f} s) | keys "
                  f"{f['keys_per_key_a_day_later']:5.2f} bytes "
                  f"{f['bytes_per_key_a_day_later']:6.1f}")  # fmt: skip
    print(f"\nelapsed {result['elapsed_s']} s")


if __name__ == "__main__":
    sys.exit(main())
