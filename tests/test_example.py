"""The README's first command: the example project's demo, run as a new user runs it.

``python -m example_project --short --json`` in a subprocess (real Redis, two real prefork
workers, beat, the external API), then the invariants asserted from its one JSON object.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from example_project.demo import REPLICATION_TTL, parse

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.local_redis]


def run_demo(*args: str) -> tuple[dict[str, Any], str]:
    command = [sys.executable, "-m", "example_project", "--short", "--json", *args]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, f"demo exited {done.returncode}:\n{done.stderr[-4000:]}"
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON object, got: {done.stdout!r}"
    return json.loads(lines[0]), done.stderr


@pytest.mark.parametrize("redlock", [False, True], ids=["single", "redlock5"])
def test_the_demo_shows_the_difference(redlock: bool, tmp_path: Path) -> None:
    picture = tmp_path / "timeline.html"
    report, progress = run_demo(*(["--redlock"] if redlock else []), "--timeline", str(picture))
    plain, dlock = report["plain"], report["dlock"]

    # Without a lock the same burst overlaps, or the demo proves nothing.
    assert plain["max_concurrent_per_key"] > 1, plain
    assert plain["max_concurrent_api_calls_per_entity"] > 1, plain
    assert plain["duplicate_api_calls"] > 0, plain
    assert plain["stale_writes_accepted"] > 0, plain

    # With celery_dlock: never two runs of a key at once, no stale write through.
    assert dlock["max_concurrent_per_key"] == 1, dlock
    assert dlock["keys_run_concurrently"] == []
    assert dlock["max_concurrent_api_calls_per_entity"] == 1, dlock
    assert dlock["duplicate_api_calls"] == 0, dlock
    assert dlock["stale_writes_accepted"] == 0, dlock
    assert dlock["duplicate_jobs"] == 0, dlock
    # The paused collector's late write was refused by the fence, and its loss reported.
    assert dlock["stale_writes_rejected"] >= 1, dlock
    assert dlock["leases_lost"] >= 1, dlock
    # Duplicates were turned away, not run: replication dropped, collection requeued.
    assert dlock["dropped"] >= 1, dlock
    assert dlock["requeued"] >= 1, dlock
    # Both passes ran the whole burst (each window collected once in the dlock pass).
    assert dlock["collection_runs"] >= 1
    assert plain["collection_runs"] >= dlock["collection_runs"]

    # Replication resumed after the killed worker's lease expired: not before, not much after.
    takeover = report["takeover_seconds"]
    assert takeover is not None
    assert 0 < takeover < REPLICATION_TTL + 1 + 2.0, takeover
    assert report["ok"] is True
    assert report["problems"] == []

    assert "SIGKILLed worker" in progress
    assert "refused by the fence" in progress
    assert "<svg" in picture.read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--redis-url", "redis://a", "--redis-url", "redis://b"], "three or more for Redlock"),
        (["--timeline", "runs.png"], "must end in .svg or .html"),
    ],
)
def test_bad_arguments_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and str(os.getpid()) != entry.name:
            found.append(f"{entry.name}: {cmdline}")
    return found


def test_ctrl_c_stops_everything_the_demo_started() -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "example_project", "--short"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert demo.stdout is not None
    seen: list[str] = []
    directory = port = None
    try:
        for line in demo.stdout:  # progress lines, in order; the demo flushes each
            seen.append(line)
            if "embedded redis-server: ports" in line:
                port = line.rsplit("[", 1)[1].split("]")[0].split(",")[0].strip()
            if "tables and journals in " in line:
                directory = line.split("tables and journals in ", 1)[1].strip()
            if "--- pass 'plain'" in line:
                break
        assert directory, "".join(seen)
        assert port, "".join(seen)
        assert processes_mentioning(directory), "no worker found before the interrupt"
        demo.send_signal(signal.SIGINT)
        rest, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 130, "".join(seen) + rest
    assert "interrupted" in rest
    assert processes_mentioning(directory) == []
    assert [p for p in processes_mentioning(f"127.0.0.1:{port}") if "redis-server" in p] == []
