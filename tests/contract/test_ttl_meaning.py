"""One meaning of ``lock_ttl`` on every backend (issue 33):

* a holder that dies (SIGKILL: no release, no renewal) leaves its key free at most ``ttl``
  later;
* the holder's own view of its lease (``valid_for``) never reaches past ``ttl`` from its last
  confirmation.

On ZooKeeper a lease lives as long as its session, so the first holds when the session timeout
is no longer than the ttl (the URL's ``?timeout=``); a shorter ttl than the session timeout is
warned about, naming both and the fix, and the second still holds (docs/configuration.md,
``dlock_ttl``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from celery_dlock.core.backend import Backend
from celery_dlock.core.config import Settings
from celery_dlock.core.errors import LockContended
from celery_dlock.core.urls import backend_module
from tests.support.zookeeper import until

MODES = ["single", "redlock5", "zookeeper"]

TTL = 3.0

CHILD = """
import sys, time
from celery_dlock.core.config import Settings
from celery_dlock.core.urls import backend_module
settings = Settings(urls=tuple(sys.argv[1:]))
backend = backend_module(settings.urls).make_backend(settings)
lease = backend.acquire("ttl-meaning", ttl=float(%r))
print("held", flush=True)
time.sleep(600)
"""


def _urls(urls: list[str], timeout: float) -> list[str]:
    """On ZooKeeper, ask for a session timeout of ``timeout`` seconds."""
    if urls[0].startswith("zookeeper"):
        return [f"{urls[0]}?timeout={timeout:g}"]
    return urls


def _backend(urls: list[str]) -> Backend:
    settings = Settings(urls=tuple(urls))
    backend: Backend = backend_module(settings.urls).make_backend(settings)
    return backend


def test_a_dead_holders_key_is_free_within_the_ttl(urls: list[str]) -> None:
    urls = _urls(urls, TTL)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD % TTL, *urls],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"held"
        backend = _backend(urls)
        with pytest.raises(LockContended):
            backend.acquire("ttl-meaning", wait=0)
        os.kill(child.pid, signal.SIGKILL)
        killed = time.monotonic()
        child.wait(10)
        lease = backend.acquire("ttl-meaning", wait=3 * TTL)
        freed_after = time.monotonic() - killed
        lease.release()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
    # Free no later than the ttl after the death (a ZooKeeper server checks expiries each
    # tick, 0.2 s on the test servers; the waiter's wake-up is the rest of the margin).
    assert freed_after <= TTL + 1.0


def test_the_holders_view_never_reaches_past_the_ttl(urls: list[str]) -> None:
    backend = _backend(_urls(urls, TTL))
    lease = backend.acquire("view", ttl=TTL)
    try:
        assert 0 < lease.valid_for <= TTL
    finally:
        lease.release()


def test_a_ttl_shorter_than_the_zookeeper_session_is_warned_about_and_still_bounds_the_view(
    zookeeper_urls: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    backend = _backend(_urls(zookeeper_urls, 4 * TTL))

    def said() -> str:
        return " ".join(r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="celery_dlock.zookeeper"):
        lease = backend.acquire("short", ttl=TTL)
        try:
            assert 0 < lease.valid_for <= TTL
            # Said at its first renewal (a third of the ttl): a lease held only for a moment
            # (a beat's tick key, forgotten at once) says nothing.
            until(lambda: "lock_ttl=" in said(), TTL, "the warning")
            assert 0 < lease.valid_for <= TTL
            assert f"lock_ttl={TTL:g} s is shorter than the ZooKeeper session timeout" in said()
            assert f"?timeout={TTL:g}" in said()
        finally:
            lease.release()


def test_a_waiter_admitted_after_waiting_longer_than_its_ttl_holds_a_valid_lease(
    zookeeper_urls: list[str],
) -> None:
    # A waiter admitted by its predecessor's deletion alone skips the listing while the proof
    # of its session is "fresh"; with a ttl shorter than the session timeout that proof must
    # be fresh for the ttl too (a third of it), or the lease is born already expired. Here:
    # ttl 1 s, session 12 s, a wait of 2.5 s (between the ttl and a third of the session).
    ttl, wait = 1.0, 2.5
    backend = _backend(_urls(zookeeper_urls, 12.0))
    first = backend.acquire("admitted", ttl=ttl)
    freed = threading.Timer(wait, first.release)
    freed.start()
    try:
        lease = backend.acquire("admitted", ttl=ttl, wait=10 * wait)
        try:
            assert not lease.lost, lease.lost_reason
            assert lease.valid_for > ttl / 2
        finally:
            lease.release()
    finally:
        freed.cancel()
        first.release()
