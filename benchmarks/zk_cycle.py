"""ZooKeeper: our lock beside kazoo's own ``Lock`` recipe, in the same run on the same server.

Two measures, each for ``ours`` (``ZooKeeperBackend.acquire(key)`` / ``release()``) and
``kazoo`` (``client.Lock(path).acquire()`` / ``release()``, one Lock object reused, as kazoo's
docs show: https://kazoo.readthedocs.io/en/latest/api/recipe/lock.html):

* ``cycle``  an uncontended acquire + release, back to back, on one key;
* ``handover``  a holder holds the key while a waiter thread of the same process blocks on it
  (its node queued, watching its predecessor); the holder reads ``time.perf_counter()`` right
  before release, the waiter right after its acquire returns: the difference is one hand-over.

Each library has its own client (its own session) on one standalone server started here
(``tests/zookeeper.py``; Debian's zookeeper package) unless ``--hosts`` names one. Rounds
alternate between the two libraries; each round's median is kept and the medians of those are
printed, with ours / kazoo (below 1.0: ours is faster).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/zk_cycle.py [--rounds 7] [--cycles 200]
[--handovers 40] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery_dlock.zookeeper import ZooKeeperBackend, close_all
from tests.zookeeper import skip_reason, standalone


class Contender:
    """One library's acquire and release of one key, and a way to see a waiter queued."""

    def __init__(
        self,
        name: str,
        take: Callable[[], Any],
        give: Callable[[Any], None],
        queued: Callable[[], int],
    ) -> None:
        self.name = name
        self.take = take
        self.give = give
        self.queued = queued


def ours(hosts: str, key: str) -> Contender:
    backend = ZooKeeperBackend(f"zookeeper://{hosts}/bench?timeout=10")
    return Contender(
        "ours",
        lambda: backend.acquire(key, wait=None),
        lambda lease: lease.release(),
        lambda: len(backend.queue(key)),
    )


def kazoo(client: KazooClient, key: str) -> Contender:
    path = f"/bench-kazoo/{key}"
    locks = threading.local()

    def lock() -> Any:
        if not hasattr(locks, "lock"):  # one Lock object per thread: kazoo's Lock is not
            locks.lock = client.Lock(path)  # reentrant across threads, and a waiter is one
        return locks.lock

    def take() -> Any:
        held = lock()
        held.acquire()
        return held

    return Contender("kazoo", take, lambda held: held.release(), lambda: len(lock().contenders()))


def cycle(contender: Contender, n: int) -> float:
    """Median seconds of one acquire + release over ``n`` cycles."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        contender.give(contender.take())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def handover(contender: Contender, n: int) -> float:
    """Median seconds from the holder's release to the blocked waiter's acquire returning."""
    times = []
    for _ in range(n):
        held = contender.take()
        got: list[float] = []
        done = threading.Event()

        def wait(got: list[float] = got, done: threading.Event = done) -> None:
            lease = contender.take()
            got.append(time.perf_counter())
            contender.give(lease)
            done.set()

        waiter = threading.Thread(target=wait)
        waiter.start()
        deadline = time.monotonic() + 10
        while contender.queued() < 2:  # the waiter's node is queued and its watch set
            if time.monotonic() > deadline:
                raise RuntimeError("waiter never queued")
            time.sleep(0.002)
        time.sleep(0.005)  # its watch request is sent right after its listing: let it land
        t0 = time.perf_counter()
        contender.give(held)
        if not done.wait(10):
            raise RuntimeError("waiter never got the lock")
        waiter.join()
        times.append(got[0] - t0)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", help="an existing server (host:port,...); default: start one")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--handovers", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with server(args.hosts) as hosts:
        client = KazooClient(hosts=hosts, timeout=10)
        client.start(timeout=15)
        try:
            key = f"k-{uuid.uuid4().hex[:8]}"
            pair = [ours(hosts, key), kazoo(client, key)]
            for contender in pair:  # warm up: sessions, parent nodes, the JIT of the server
                cycle(contender, 50)
                handover(contender, 3)
            results: dict[str, dict[str, list[float]]] = {
                c.name: {"cycle": [], "handover": []} for c in pair
            }
            for r in range(args.rounds):
                order = pair if r % 2 == 0 else pair[::-1]
                for contender in order:
                    results[contender.name]["cycle"].append(cycle(contender, args.cycles))
                for contender in order:
                    results[contender.name]["handover"].append(handover(contender, args.handovers))
        finally:
            client.stop()
            client.close()
            close_all()
    summary = {
        name: {m: statistics.median(v) * 1000 for m, v in measures.items()}
        for name, measures in results.items()
    }
    if args.json:
        print(json.dumps({"rounds": args.rounds, "ms": summary, "raw_s": results}, indent=2))
        return
    print(f"{args.rounds} rounds, {args.cycles} cycles and {args.handovers} hand-overs each")
    for measure in ("cycle", "handover"):
        a, b = summary["ours"][measure], summary["kazoo"][measure]
        print(f"{measure:9} ours {a:7.3f} ms   kazoo {b:7.3f} ms   ours/kazoo {a / b:5.2f}")


if __name__ == "__main__":
    main()
