"""ZooKeeper: our lock beside kazoo's own ``Lock`` recipe, in the same run on the same server.

Two measures, each for ``ours`` (``ZooKeeperBackend.acquire(key)`` / ``release()``), ``lock``
(the public path users write, ``with celery_dlock.lock([zookeeper_url], key)``) and ``kazoo``
(``client.Lock(path).acquire()`` / ``release()``, one Lock object reused, as kazoo's docs show:
https://kazoo.readthedocs.io/en/latest/api/recipe/lock.html), and for scale ``redis``: our
public path on one local redis-server (``with celery_dlock.lock([redis_url], key)``), in the
same run:

* ``cycle``  an uncontended acquire + release, back to back, on one key;
* ``handover``  a holder holds the key while a waiter blocks on it (its node queued, watching
  its predecessor); the holder reads ``time.perf_counter()`` right before release, the waiter
  right after its acquire returns: the difference is one hand-over. The waiter is a process of
  its own with its own client (``--mode process``, the default: two workers), or a thread of
  the holder's process sharing its client (``--mode thread``).

Each library has its own client (its own session) on one standalone server started here
(``tests/support/zookeeper.py``; Debian's zookeeper package) unless ``--hosts`` names one. That test
server runs with ``forceSync=no`` (no fsync per write) and, unless ``--jit full``, a C1-only
JIT: a production ensemble fsyncs every write to its transaction log before it answers, so
add the disk's sync latency to every acquire and release (not to a refusal's reads). Rounds
alternate between the two libraries; each round's median is kept and the medians of those are
printed, with ours / kazoo (below 1.0: ours is faster).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/zk_cycle.py [--rounds 7] [--cycles 200]
[--handovers 40] [--mode process|thread] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient
from redis import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import celery_dlock
import tests.support.zookeeper as zk_servers
from celery_dlock.backends.zookeeper import ZooKeeperBackend, close_all
from celery_dlock.testing import RedisServer
from tests.support.zookeeper import skip_reason, standalone


class Contender:
    """One library's acquire and release of one key, and a way to see a waiter queued."""

    def __init__(
        self,
        name: str,
        take: Callable[[], Any],
        give: Callable[[Any], None],
        queued: Callable[[], int],
        close: Callable[[], None],
    ) -> None:
        self.name = name
        self.take = take
        self.give = give
        self.queued = queued
        self.close = close


def ours(hosts: str, key: str) -> Contender:
    backend = ZooKeeperBackend(f"zookeeper://{hosts}/bench?timeout=10")
    return Contender(
        "ours",
        lambda: backend.acquire(key, wait=None),
        lambda lease: lease.release(),
        lambda: len(backend.queue(key)),
        close_all,
    )


def public(hosts: str, key: str) -> Contender:
    """``with celery_dlock.lock([url], key)``, entered and left by hand."""
    url = f"zookeeper://{hosts}/bench-public?timeout=10"
    return _public("lock", url, key, lambda: len(ZooKeeperBackend(url).queue(key)), close_all)


def redis(url: str, key: str) -> Contender:
    """The same public path on one redis-server; a waiter is seen blocked in BLPOP."""
    monitor = Redis.from_url(url)

    def queued() -> int:
        blocked = [c for c in monitor.client_list() if "b" in str(c.get("flags", ""))]
        return 1 + len(blocked)

    return _public("redis", url, key, queued, monitor.close)


def _public(
    name: str, url: str, key: str, queued: Callable[[], int], close: Callable[[], None]
) -> Contender:
    def take() -> Any:
        guard = celery_dlock.lock([url], key, wait=None)
        guard.__enter__()
        return guard

    return Contender(name, take, lambda guard: guard.__exit__(None, None, None), queued, close)


def kazoo(hosts: str, key: str) -> Contender:
    client = KazooClient(hosts=hosts, timeout=10)
    client.start(timeout=15)
    path = f"/bench-kazoo/{key}"
    locks = threading.local()

    def lock() -> Any:
        if not hasattr(locks, "lock"):  # one Lock object per thread: a Lock is one contender
            locks.lock = client.Lock(path)
        return locks.lock

    def take() -> Any:
        held = lock()
        held.acquire()
        return held

    def close() -> None:
        client.stop()
        client.close()

    return Contender(
        "kazoo", take, lambda held: held.release(), lambda: len(lock().contenders()), close
    )


MAKERS: dict[str, Callable[[str, str], Contender]] = {
    "ours": ours,
    "lock": public,
    "kazoo": kazoo,
    "redis": redis,
}


def cycle(contender: Contender, n: int) -> float:
    """Median seconds of one acquire + release over ``n`` cycles."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        contender.give(contender.take())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Waiter:
    """The waiting side of a hand-over: a thread of this process, or a process of its own
    (with its own client and session, as two workers would be). Each ``go()`` makes it
    acquire once (blocking), read ``perf_counter()`` and release; ``got()`` returns that
    reading. On Linux ``perf_counter`` is ``CLOCK_MONOTONIC``, one clock for all processes."""

    def __init__(self, name: str, where: str, key: str, mode: str, here: Contender) -> None:
        self.mode = mode
        if mode == "process":
            ctx = multiprocessing.get_context("fork")
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=_waiter_process, args=(name, where, key, child))
            self._proc.start()
        else:
            self._here = here
            self._times: list[float] = []
            self._done = threading.Event()

    def go(self) -> None:
        if self.mode == "process":
            self._conn.send("go")
            return
        self._done.clear()

        def run() -> None:
            held = self._here.take()
            self._times.append(time.perf_counter())
            self._here.give(held)
            self._done.set()

        threading.Thread(target=run, daemon=True).start()

    def got(self) -> float:
        if self.mode == "process":
            if not self._conn.poll(10):
                raise RuntimeError("waiter never got the lock")
            reading: float = self._conn.recv()
            return reading
        if not self._done.wait(10):
            raise RuntimeError("waiter never got the lock")
        return self._times.pop()

    def close(self) -> None:
        if self.mode == "process":
            self._conn.send("stop")
            self._proc.join(10)


def _waiter_process(name: str, where: str, key: str, conn: Any) -> None:
    contender = MAKERS[name](where, key)
    try:
        while conn.recv() == "go":
            held = contender.take()
            conn.send(time.perf_counter())
            contender.give(held)
    finally:
        contender.close()


def handover(contender: Contender, waiter: Waiter, n: int) -> float:
    """Median seconds from the holder's release to the blocked waiter's acquire returning."""
    times = []
    for _ in range(n):
        held = contender.take()
        waiter.go()
        deadline = time.monotonic() + 10
        while contender.queued() < 2:  # the waiter's node is queued
            if time.monotonic() > deadline:
                raise RuntimeError("waiter never queued")
            time.sleep(0.002)
        time.sleep(0.02)  # its watch request is sent right after its listing: let it land
        t0 = time.perf_counter()
        contender.give(held)
        times.append(waiter.got() - t0)
    return statistics.median(times)


@contextlib.contextmanager
def server(hosts: str | None) -> Iterator[str]:
    if hosts:
        yield hosts
        return
    reason = skip_reason()
    if reason:
        raise SystemExit(reason)
    with standalone() as zk:
        yield zk.hosts


@contextlib.contextmanager
def full_jit(on: bool) -> Iterator[None]:
    """The test server's JVM without its C1-only flag (a production server's JIT)."""
    saved = list(zk_servers.JAVA_OPTS)
    if on:
        zk_servers.JAVA_OPTS[:] = [o for o in saved if not o.startswith("-XX:TieredStopAtLevel")]
    try:
        yield
    finally:
        zk_servers.JAVA_OPTS[:] = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", help="an existing server (host:port,...); default: start one")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--handovers", type=int, default=40)
    parser.add_argument(
        "--mode",
        choices=("process", "thread"),
        default="process",
        help="the hand-over's waiter: a process of its own (default) or a thread of this one",
    )
    parser.add_argument(
        "--jit", choices=("c1", "full"), default="c1", help="the started server's JIT"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with full_jit(args.jit == "full"), server(args.hosts) as hosts, RedisServer() as rs:
        key = f"k-{uuid.uuid4().hex[:8]}"
        where = {"ours": hosts, "lock": hosts, "kazoo": hosts, "redis": rs.url}
        pair = [MAKERS[name](where[name], key) for name in where]
        waiters = {c.name: Waiter(c.name, where[c.name], key, args.mode, c) for c in pair}
        try:
            for contender in pair:  # warm up: sessions, parent nodes, the JIT of the server
                cycle(contender, 50)
                handover(contender, waiters[contender.name], 3)
            results: dict[str, dict[str, list[float]]] = {
                c.name: {"cycle": [], "handover": []} for c in pair
            }
            for r in range(args.rounds):
                order = pair if r % 2 == 0 else pair[::-1]
                for contender in order:
                    results[contender.name]["cycle"].append(cycle(contender, args.cycles))
                for contender in order:
                    results[contender.name]["handover"].append(
                        handover(contender, waiters[contender.name], args.handovers)
                    )
        finally:
            for waiter in waiters.values():
                waiter.close()
            for contender in pair:
                contender.close()
    summary = {
        name: {m: statistics.median(v) * 1000 for m, v in measures.items()}
        for name, measures in results.items()
    }
    if args.json:
        out = {
            "rounds": args.rounds,
            "mode": args.mode,
            "jit": args.jit,
            "ms": summary,
            "raw_s": results,
        }
        print(json.dumps(out, indent=2))
        return
    print(
        f"{args.rounds} rounds, {args.cycles} cycles and {args.handovers} hand-overs each "
        f"(waiter: {args.mode})"
    )
    for measure in ("cycle", "handover"):
        row = "   ".join(f"{n} {summary[n][measure]:7.3f} ms" for n in summary)
        ratios = "   ".join(
            f"{n}/kazoo {summary[n][measure] / summary['kazoo'][measure]:5.2f}"
            for n in ("ours", "lock")
        )
        print(f"{measure:9} {row}   {ratios}")


if __name__ == "__main__":
    main()
