"""A tour of ``lock()``: a distributed lock's life on real Redis, narrated.

    python -m example_project.lock_tour                  # one embedded Redis
    python -m example_project.lock_tour --redlock        # five embedded Redis masters (Redlock)
    python -m example_project.lock_tour --redis-url redis://host:6379/0 [--redis-url ...]

It takes a lease and watches it being renewed, shows a contender refused with the holder's
name, a waiter woken the moment the lease is released, fencing tokens that only go up, and a
lease reported lost when its key disappears. Exits 0 when everything behaved as described.
The Celery example (workers, beat, the metadata table) is ``python -m example_project``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Iterator

import redis

import celery_dlock
from celery_dlock import Lease, LockContended, LockLost, lock
from celery_dlock.testing import redis_servers

T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - T0:6.2f}s] {message}", flush=True)


@contextlib.contextmanager
def redis_urls(args: argparse.Namespace) -> Iterator[list[str]]:
    if args.redis_url:
        yield args.redis_url
        return
    count = 5 if args.redlock else 1
    with redis_servers(count) as servers:
        say(f"started {count} embedded redis-server process(es): {[s.port for s in servers]}")
        yield [s.url for s in servers]


def run(urls: list[str]) -> bool:
    ok = True
    mode = f"Redlock over {len(urls)} masters" if len(urls) > 1 else "a single Redis"
    say(f"celery_dlock {celery_dlock.__version__} on {mode}")

    # 1. Take a lease and let the watchdog renew it past several ttls.
    ttl = 1.0
    lease = lock(urls, "demo:replicate", ttl=ttl, holder="task-A").acquire()
    say(f"task-A holds {lease.key!r}: fencing token {lease.token}, valid {lease.valid_for:.2f}s")
    end = time.monotonic() + 3 * ttl
    while time.monotonic() < end:
        time.sleep(ttl / 2)
        say(f"  renewed {lease.renewals}x, valid for {lease.valid_for:.2f}s more")
    ok &= lease.renewals >= 6 and not lease.lost

    # 2. A contender that will not wait is refused, and told who holds the key.
    try:
        lock(urls, "demo:replicate", ttl=ttl).acquire()
        say("!! a second holder got in")
        ok = False
    except LockContended as exc:
        say(f"task-B refused at once: {exc}")

    # 3. A contender that waits is woken by the release itself, not by polling.
    got: list[tuple[float, Lease]] = []

    def waiter() -> None:
        waited = lock(urls, "demo:replicate", ttl=ttl, wait=10).acquire()
        got.append((time.monotonic(), waited))

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)  # let task-C block (demo pacing, not synchronisation)
    released_at = time.monotonic()
    lease.release()
    thread.join(timeout=10)
    if got:
        took_over, second = got[0]
        say(
            f"task-A released; task-C took over {1000 * (took_over - released_at):.2f} ms later "
            f"with fencing token {second.token} (> {lease.token})"
        )
        ok &= second.token > lease.token
    else:
        say("!! the waiter never got the lock")
        return False

    # 4. Someone deletes the key behind task-C's back: the next renewal notices.
    lost = threading.Event()

    def told(_lease: Lease, error: LockLost) -> None:
        say(f"task-C told: {error.reason}")
        lost.set()

    second.on_lost(told)
    for url in urls:
        client = redis.Redis.from_url(url)
        client.delete(f"dlock:{{{second.key}}}")
        client.close()
    say("deleted the key in Redis behind task-C's back")
    ok &= lost.wait(timeout=2 * ttl)
    try:
        second.ensure()
        ok = False
    except LockLost:
        say("task-C's lease.ensure() now raises LockLost: it must not touch the resource")
    second.release()
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m example_project", description=__doc__)
    parser.add_argument("--redis-url", action="append", help="use this Redis (repeat for Redlock)")
    parser.add_argument("--redlock", action="store_true", help="five embedded masters")
    args = parser.parse_args(argv)
    with redis_urls(args) as urls:
        ok = run(urls)
    say("demo OK" if ok else "demo FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
