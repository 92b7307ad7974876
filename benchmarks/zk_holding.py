"""ZooKeeper: what holding N leases costs, beside kazoo's own ``Lock`` recipe, in one run.

For each N (10, 100, 1,000 by default) each library takes N keys and holds them; the requests
the server receives from that library's session over a window are counted on the server (the
``recved`` count of the session's connection in the ``cons`` four-letter command) and printed
per second. ``ours`` is ``ZooKeeperBackend.acquire(key)`` (session nodes, kept valid by the
watchdog); ``kazoo`` is ``client.Lock(path).acquire()``, one ``Lock`` per key, on a client of
its own. Both ask for the same session timeout (``--timeout``, 9 s): kazoo's client pings the
server after a third of it without traffic, our watchdog confirms the session every third of
it (issue 33: one request per session, not one per lease).

One standalone server is started here (``tests/support/zookeeper.py``, Debian's zookeeper package)
unless ``--hosts`` names one (its first host is asked for ``cons``).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/zk_holding.py [--counts 10,100,1000]
[--timeout 9] [--window 9] [--json]`` (about 4 s per library and N, plus the window each).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery_dlock.backends.zookeeper import ZooKeeperBackend, close_all
from tests.support.zookeeper import four_letter, skip_reason, standalone


def received(port: int, sid: int) -> int:
    """Requests the server received on the connection of session ``sid`` (``cons``)."""
    for line in four_letter(port, "cons", timeout=5.0).splitlines():
        if f"sid=0x{sid:x}," in line or f"sid=0x{sid:x})" in line:
            found = re.search(r"recved=(\d+)", line)
            if found:
                return int(found.group(1))
    raise RuntimeError(f"session 0x{sid:x} not in the server's connections")


def hold_ours(hosts: str, n: int, timeout: float) -> tuple[int, Callable[[], None]]:
    backend = ZooKeeperBackend(
        f"zookeeper://{hosts}/hold-{uuid.uuid4().hex[:6]}?timeout={timeout:g}"
    )
    leases = [backend.acquire(f"k{i}") for i in range(n)]

    def close() -> None:
        for lease in leases:
            lease.release()
        close_all()

    return int(backend.shared.client.client_id[0]), close


def hold_kazoo(hosts: str, n: int, timeout: float) -> tuple[int, Callable[[], None]]:
    client = KazooClient(hosts=hosts, timeout=timeout)
    client.start(timeout=15)
    base = f"/hold-kazoo-{uuid.uuid4().hex[:6]}"
    locks = [client.Lock(f"{base}/k{i}") for i in range(n)]
    for held in locks:
        held.acquire()

    def close() -> None:
        for held in locks:
            held.release()
        client.stop()
        client.close()

    return int(client.client_id[0]), close


HOLDERS: dict[str, Callable[[str, int, float], tuple[int, Callable[[], None]]]] = {
    "ours": hold_ours,
    "kazoo": hold_kazoo,
}


def rate(hosts: str, port: int, name: str, n: int, timeout: float, window: float) -> float:
    """Requests per second the server receives from ``name``'s session holding ``n`` keys."""
    sid, close = HOLDERS[name](hosts, n, timeout)
    try:
        time.sleep(timeout / 3)  # past the first renewals of the leases taken last
        before = received(port, sid)
        began = time.monotonic()
        time.sleep(window)
        after = received(port, sid)
        return (after - before) / (time.monotonic() - began)
    finally:
        close()


@contextlib.contextmanager
def server(hosts: str | None) -> Iterator[tuple[str, int]]:
    if hosts:
        yield hosts, int(hosts.split(",")[0].rsplit(":", 1)[1])
        return
    reason = skip_reason()
    if reason:
        raise SystemExit(reason)
    with standalone() as zk:
        yield zk.hosts, zk.client_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="10,100,1000")
    parser.add_argument("--timeout", type=float, default=9.0)
    parser.add_argument("--window", type=float, default=9.0)
    parser.add_argument("--hosts")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    results: dict[str, Any] = {"timeout": args.timeout, "window": args.window, "rows": []}
    with server(args.hosts) as (hosts, port):
        for n in counts:
            row = {"n": n}
            for name in HOLDERS:
                row[name] = rate(hosts, port, name, n, args.timeout, args.window)
            row["ratio"] = row["ours"] / row["kazoo"] if row["kazoo"] else float("inf")
            results["rows"].append(row)
            if not args.json:
                print(
                    f"N={n:>5}  ours {row['ours']:7.2f} req/s  kazoo {row['kazoo']:6.2f} req/s"
                    f"  ours/kazoo {row['ratio']:.2f}",
                    flush=True,
                )
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
