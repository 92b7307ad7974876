"""``celery -A proj dlock ...`` run as a real subprocess against real Redis (single, Redlock-5)
and a real ZooKeeper server.

Leases are taken in this process; the command, a separate process reading the same app's
settings, lists, shows, releases and purges them. A released holder notices at its next
renewal, and the fencing counter has moved on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from celery_dlock import LockLost
from celery_dlock.backends.redis.redlock import LockManager
from celery_dlock.testing import RedisServer, free_port
from tests.support import cli_app

ROOT = Path(__file__).resolve().parents[2]
#: The ``urls`` fixture's stores this module runs on (tests/conftest.py).
MODES = ["single", "redlock5", "zookeeper"]


def on_zookeeper(urls: list[str]) -> bool:
    return urls[0].startswith("zookeeper://")


def dlock(urls: list[str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DLOCK_TEST_LOCK_URLS": ",".join(urls), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "celery", "-A", "tests.support.cli_app", "dlock", *args]
    return subprocess.run(
        command, env=env, cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip


@pytest.fixture
def manager(urls: list[str]) -> Any:
    from celery_dlock.core.registry import forget, manager_for

    cli_app.app.conf.dlock_urls = urls
    forget(cli_app.app)  # the app's settings are read once; read them again
    return manager_for(cli_app.app)


def test_list_and_show_what_is_held(urls: list[str], manager: LockManager) -> None:
    task = cli_app.replicate
    # Not renewed: the ttl outlasts the seven commands (a second or two each on a busy host).
    first = manager.acquire("meta:crm:acme", ttl=30, holder="task-1", sender=task, renew=False)
    second = manager.acquire("beat-leader:proj", ttl=30, holder=None, renew=False)
    try:
        listed = dlock(urls, "list", "--json")
        assert listed.returncode == 0, listed.stderr
        rows = {r["key"]: r for r in map(json.loads, listed.stdout.splitlines())}
        assert set(rows) == {"meta:crm:acme", "beat-leader:proj"}
        row = rows["meta:crm:acme"]
        assert row["task"] == "cli_app.replicate"
        assert row["task_id"] == "task-1"
        assert row["pid"] == os.getpid()
        assert row["fence"] == first.token
        if on_zookeeper(urls):
            assert row["ttl_left"] is None  # no ttl: held while the holder's session lives
        else:
            assert 0 < row["ttl_left"] <= 30
        assert 0 <= row["age"] < 30
        assert rows["beat-leader:proj"]["fence"] == second.token

        only = dlock(urls, "list", "--prefix", "meta:")
        assert only.returncode == 0, only.stderr
        assert "meta:crm:acme" in only.stdout
        assert "beat-leader" not in only.stdout
        assert "None" not in only.stdout

        shown = json.loads(dlock(urls, "show", "meta:crm:acme", "--json").stdout)
        assert shown["held"] is True
        assert shown["task_id"] == "task-1"
        missing_json = dlock(urls, "show", "meta:nobody", "--json")
        assert missing_json.returncode == 1, missing_json.stderr  # free: like `test -e`
        assert json.loads(missing_json.stdout)["held"] is False

        text = dlock(urls, "show", "meta:crm:acme")
        assert text.returncode == 0, text.stderr
        assert "task_id   task-1" in text.stdout
        assert f"fence     {first.token}" in text.stdout
        assert "None" not in text.stdout
        free = dlock(urls, "show", "meta:nobody")
        assert free.returncode == 1, free.stderr
        assert free.stdout.startswith("'meta:nobody' is not held")
        if on_zookeeper(urls):
            # The table and the record say what a missing ttl means, and where the locks are.
            assert "ZooKeeper server: zookeeper://127.0.0.1:" in only.stdout
            assert "ttl_left -: no expiry: held for as long as its holder's ZooKeeper session" in (
                only.stdout
            )
            assert "ttl_left  - (no expiry: held for as long as its holder's" in text.stdout
            assert free.stdout.strip() == "'meta:nobody' is not held"
    finally:
        first.release()
        second.release()


def test_release_tells_the_holder_and_moves_the_fence_on(
    urls: list[str], manager: LockManager
) -> None:
    lost = threading.Event()
    lease = manager.acquire("replication", ttl=1.5, holder="task-9")
    lease.on_lost(lambda _lease, _error: lost.set())
    try:
        refused = dlock(urls, "release", "replication", stdin="n\n")
        assert refused.returncode != 0
        assert not lost.is_set()
        assert manager.holder("replication") is not None

        done = dlock(urls, "release", "replication", "--yes", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"key": "replication", "released": True, "held": True}
        # The holder learns at its next renewal (every 0.5 s here), not when its ttl runs out.
        assert lost.wait(0.5 + 0.5), "the holder did not notice the forced release"
        assert lease.lost_reason is not None
        assert "operator" in lease.lost_reason
        with pytest.raises(LockLost):
            lease.ensure()
        # Its renewal did not bring the key back, and the next holder's token is newer.
        assert manager.holder("replication") is None
        info = manager.inspect("replication")
        if not on_zookeeper(urls):  # ZooKeeper keeps no counter for a free key
            assert info.fence is not None
            assert info.fence > lease.token
        after = manager.acquire("replication", ttl=2, renew=False)
        assert after.token > lease.token
        after.release()
    finally:
        lease.release()


def test_purge_releases_a_prefix_and_nothing_else(urls: list[str], manager: LockManager) -> None:
    # Not renewed: the ttl outlasts two commands on a busy host (5 s did not, at load 11).
    leases = [manager.acquire(f"meta:crm:{n}", ttl=30, renew=False) for n in ("a", "b", "c")]
    other = manager.acquire("meta-other", ttl=30, renew=False)
    try:
        empty = dlock(urls, "purge", "", "--yes")
        assert empty.returncode != 0
        assert "non-empty prefix" in empty.stderr
        done = dlock(urls, "purge", "meta:crm:", "--yes", "--json")
        assert done.returncode == 0, done.stderr
        assert sorted(json.loads(done.stdout)["released"]) == [
            "meta:crm:a",
            "meta:crm:b",
            "meta:crm:c",
        ]
        assert [manager.holder(f"meta:crm:{n}") for n in ("a", "b", "c")] == [None] * 3
        assert manager.holder("meta-other") is not None
    finally:
        for lease in [*leases, other]:
            lease.release()


def test_queued_locks_are_shown_as_queued_and_freed_apart(
    urls: list[str], manager: LockManager
) -> None:
    # A message's queued lock (enqueue-time mode) whose message will never run: purged from
    # the broker, routed to a queue nobody consumes, or its publisher killed before sending.
    task = cli_app.replicate
    queued = manager.acquire(
        "meta:crm:queued", ttl=30, holder="task-q", sender=task, renew=False, queued=True
    )
    running = manager.acquire("meta:crm:running", ttl=30, holder="task-r", sender=task, renew=False)
    plain = manager.acquire("meta:crm:plain", ttl=30, holder=None, renew=False)
    try:
        listed = dlock(urls, "list", "--json")
        assert listed.returncode == 0, listed.stderr
        rows = {r["key"]: r for r in map(json.loads, listed.stdout.splitlines())}
        assert rows["meta:crm:queued"]["state"] == "queued"
        assert rows["meta:crm:queued"]["task_id"] == "task-q"
        assert 0 <= rows["meta:crm:queued"]["age"] < 30
        assert rows["meta:crm:running"]["state"] == "running"
        assert rows["meta:crm:plain"]["state"] == "held"

        table = dlock(urls, "list", "--prefix", "meta:crm:")
        assert table.returncode == 0, table.stderr
        header, *lines = table.stdout.splitlines()[1:]
        assert header.split()[:3] == ["key", "state", "task"], header
        states = {line.split()[0]: line.split()[1] for line in lines if line.startswith("meta:")}
        assert states == {
            "meta:crm:queued": "queued",
            "meta:crm:running": "running",
            "meta:crm:plain": "held",
        }

        # The way out: release only the queued locks under a prefix; the running one stays.
        done = dlock(urls, "purge", "meta:crm:", "--queued", "--yes", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["released"] == ["meta:crm:queued"]
        assert manager.holder("meta:crm:queued") is None
        assert manager.holder("meta:crm:running") is not None

        again = manager.acquire(
            "meta:crm:queued", ttl=30, holder="task-q2", sender=task, renew=False, queued=True
        )
        released = dlock(urls, "release", "meta:crm:queued", "--yes")
        assert released.returncode == 0, released.stderr
        # Nobody runs under a queued lock: there is no holder to tell.
        assert "next renewal" not in released.stdout
        assert "queued lock of task task-q2" in released.stdout
        manager.forget(again)
    finally:
        for lease in (queued, running, plain):
            lease.release()


@pytest.mark.local_redis
def test_passwords_in_urls_are_never_printed() -> None:
    with RedisServer(extra_args=["--requirepass", "s3cret-pw"]) as server:
        url = f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
        shown = dlock([url], "list")
        assert shown.returncode == 0, shown.stderr
        assert "s3cret-pw" not in shown.stdout + shown.stderr
        assert f"127.0.0.1:{server.port}" in shown.stdout
        wrong = dlock([f"redis://:nope@127.0.0.1:{server.port}/0"], "list")
        assert wrong.returncode != 0
        assert "nope" not in wrong.stdout + wrong.stderr


def test_a_command_without_an_app_says_pass_the_app(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "APP"))}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "dlock", "list"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pass -A/--app" in done.stderr, done.stderr
    assert "broker is not Redis" not in done.stderr


@pytest.mark.parametrize("how", ["-b", "CELERY_BROKER_URL"])
def test_a_command_without_an_app_uses_the_broker_given_by_b_or_the_environment(
    tmp_path: Path, single_urls: list[str], how: str
) -> None:
    """Celery's own ``-b`` (and CELERY_BROKER_URL, which it sets) names the broker, so the
    locks are known without -A: no "pass -A", and the broker's Redis is listed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "APP"))}
    command = [sys.executable, "-m", "celery", "dlock", "list"]
    if how == "-b":
        command[3:3] = ["-b", single_urls[0]]
    else:
        env["CELERY_BROKER_URL"] = single_urls[0]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pass -A" not in done.stderr, done.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_show_tells_a_free_lock_from_nodes_it_cannot_read(as_json: bool) -> None:
    """``show`` exits 1 for a free lock (like ``test -e``); when the nodes cannot be read it
    knows nothing, so it must not say "free" by its status: 2, as grep does for an error."""
    down = [f"redis://127.0.0.1:{free_port()}/0"]  # nothing listens there
    done = dlock(down, "show", "meta:crm:acme", *(["--json"] if as_json else []))
    assert done.returncode == 2, (done.returncode, done.stdout + done.stderr)
    assert done.stderr.startswith("Error: "), done.stderr
    assert "Traceback" not in done.stderr
