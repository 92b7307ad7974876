"""The README's first command: the example project's demo, run as a new user runs it.

``python -m example_project --short --json`` in a subprocess (real Redis, two real prefork
workers, beat, the external API), then the invariants asserted from its one JSON object.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from example_project.demo import REPLICATION_TTL, parse

ROOT = Path(__file__).resolve().parents[2]

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


def run_directory(progress: str) -> Path:
    """The directory the demo said it keeps its tables, journals and logs in."""
    found = re.search(r"tables, journals and logs in (\S+)", progress)
    assert found, progress
    return Path(found.group(1))


@pytest.mark.parametrize("redlock", [False, True], ids=["single", "redlock5"])
def test_the_demo_shows_the_difference(redlock: bool, tmp_path: Path) -> None:
    picture = tmp_path / "timeline.html"
    # The Redlock run also keeps its directory (--keep); the other one removes it.
    extra = ["--redlock", "--keep"] if redlock else []
    report, progress = run_demo(*extra, "--timeline", str(picture))
    directory = run_directory(progress)
    if redlock:
        assert (directory / "dlock" / "journal.db").is_file(), progress
        assert any(directory.glob("w1*.log")), list(directory.iterdir())
        assert f"kept in {directory}" in progress
        shutil.rmtree(directory)
    else:
        assert not directory.exists(), f"the demo left {directory} behind"
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


MARK = "DLOCK_DEMO_TEST_RUN"  # set in the demo's environment, inherited by all it starts
PORTS = re.compile(r"embedded redis-server: ports \[([\d, ]+)\]")


def processes_of_the_demo(marker: str, output: str) -> list[str]:
    """Live processes the demo started: those whose environment holds ``marker`` (workers,
    their pools, beat), and redis-servers on the ports it printed (redis-server rewrites its
    process title over its environment, so the marker is gone from its environ)."""
    ports = [p.strip() for found in PORTS.findall(output) for p in found.split(",")]
    titles = [f"redis-server 127.0.0.1:{port}" for port in ports]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or entry.name == str(os.getpid()):
            continue
        try:
            environ = (entry / "environ").read_bytes()  # empty for a zombie
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "-m example_project" in cmdline:
            continue  # the demo itself
        if marker.encode() in environ or any(title in cmdline for title in titles):
            found.append(f"{entry.name}: {cmdline}")
    return found


def wait_none_left(marker: str, output: str, timeout: float = 5.0) -> list[str]:
    """The demo's processes still alive ``timeout`` s after it exited; [] as soon as none is.

    The demo waits for each process it stops, but not for the pool children it SIGKILLs with
    their group: they may take a moment to die."""
    deadline = time.monotonic() + timeout
    while (left := processes_of_the_demo(marker, output)) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling /proc with a deadline: there is nothing to wait on
    return left


@dataclass(frozen=True)
class Moment:
    """When the signal goes: at the output line ``trigger``, with the demo paused at the point
    ``pause_at`` (see example_project.stopping) if one is named; ``alive`` names a process of
    the demo's that must be running then, ``after`` a line that must have come before."""

    trigger: str
    pause_at: str | None = None
    alive: str | None = None
    after: str | None = None


MOMENTS = {
    # Before the demo's imports: a KeyboardInterrupt in one of them (a dataclass's generated
    # __init__ is exec'd) made CPython 3.11 end with -SIGINT after the demo returned 130.
    "imports": Moment("paused at start", "start"),
    "redis-start": Moment("paused at redis", "redis", alive="redis-server"),
    "worker-spawn": Moment("paused at spawn w1", "spawn w1", alive="worker"),  # not yet ready
    # The first pass begins: beat being spawned, the first task sent, which creates the task
    # classes (Celery exec's each one's header). Fresh-clone CI got -2 here.
    "pass": Moment("--- pass 'plain'", alive="worker"),
    # The whole --short run is done and the demo is stopping its processes (~25-45 s): the
    # first it stops is w3, the worker started in place of the one killed in the dlock pass.
    "final-stop": Moment("paused at stop w3", "stop w3", alive="worker", after="stopping workers"),
}
CASES = [
    pytest.param(signum, moment, id=f"{signum.name}-{moment}")
    for moment in MOMENTS
    for signum in (signal.SIGINT, signal.SIGTERM)
    # The final stop costs a whole run; SIGTERM reaches the same handler as SIGINT (the
    # other moments show it), so only Ctrl-C is sent there.
    if not (moment == "final-stop" and signum == signal.SIGTERM)
]


def start_demo(
    pause_at: str | None = None, new_session: bool = False
) -> tuple[subprocess.Popen[str], str]:
    """The demo (--short, output piped) and the ``MARK=value`` its processes' environs hold."""
    run = uuid.uuid4().hex
    env = {**os.environ, MARK: run}
    if pause_at:
        env["EXAMPLE_DEMO_PAUSE_AT"] = pause_at
    demo = subprocess.Popen(
        [sys.executable, "-m", "example_project", "--short"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=new_session,
    )  # fmt: skip
    return demo, f"{MARK}={run}"


def signal_at(
    demo: subprocess.Popen[str], marker: str, when: Moment, send: Callable[[], None]
) -> str:
    """Read the demo's output up to ``when.trigger``, ``send()`` the signal, assert that the
    demo stopped everything it started and exited 130; its whole output."""
    assert demo.stdout is not None
    seen: list[str] = []
    try:
        for line in demo.stdout:  # progress lines, in order; the demo flushes each
            seen.append(line)
            if when.trigger in line:
                break
        else:
            pytest.fail(f"the demo exited {demo.wait()} before {when.trigger!r}:\n{''.join(seen)}")
        if when.after:
            assert any(when.after in line for line in seen), "".join(seen)
        if when.alive:
            running = processes_of_the_demo(marker, "".join(seen))
            assert any(when.alive in p for p in running), (when, running, "".join(seen))
        send()
        seen.append(demo.communicate(timeout=60)[0])
        output = "".join(seen)
        assert demo.returncode == 130, output
        assert "interrupted: every process the demo started is stopped" in output, output
        assert wait_none_left(marker, output) == [], output
        if "tables, journals and logs in" in output:  # an interrupted run tidies up too
            assert not run_directory(output).exists(), output
        return output
    finally:
        clean_up_after(demo, marker, "".join(seen))


def clean_up_after(demo: subprocess.Popen[str], marker: str, output: str) -> None:
    """After a failure too, leave nothing of the demo's running: SIGTERM it (it stops what it
    started), and SIGKILL what is still left after that."""
    if demo.poll() is None:
        demo.terminate()
        try:
            demo.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            demo.kill()
            demo.communicate()
    for process in processes_of_the_demo(marker, output):
        with contextlib.suppress(OSError):
            os.kill(int(process.split(":")[0]), signal.SIGKILL)


@pytest.mark.parametrize(("signum", "moment"), CASES)
def test_a_stop_signal_at_any_moment_stops_everything_the_demo_started(
    signum: signal.Signals, moment: str
) -> None:
    demo, marker = start_demo(pause_at=MOMENTS[moment].pause_at)
    output = signal_at(demo, marker, MOMENTS[moment], lambda: demo.send_signal(signum))
    # Nothing failed on the way (the demo reports an error it meets while stopping): only a
    # terminal's Ctrl-C, which stops the embedded redis-server too, may cause one.
    assert "while stopping:" not in output, output


def test_ctrl_c_in_a_terminal_also_reaching_the_embedded_redis_stops_everything() -> None:
    """A terminal's Ctrl-C goes to its whole foreground process group: the demo and the
    embedded redis-server (workers and beat have sessions of their own)."""
    demo, marker = start_demo(new_session=True)  # a group of its own, as a terminal's job
    mid_pass = Moment("plain: sent", alive="worker")  # workers busy, beat sending
    signal_at(demo, marker, mid_pass, lambda: os.killpg(demo.pid, signal.SIGINT))


PROBE = """
import os, signal, sys
from example_project import stopping

stopping.install()
# The signal arrives inside code run by exec() of a string, as in a dataclass's or a Celery
# task's generated code: a KeyboardInterrupt leaving it makes CPython 3.11 end with -SIGINT.
exec("os.kill(os.getpid(), signal.SIGINT)")
try:
    stopping.check()
except stopping.Interrupted:
    sys.exit(130)
"""


def test_a_stop_signal_landing_in_exec_d_code_still_exits_130(tmp_path: Path) -> None:
    (tmp_path / "stop_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "stop_probe"], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 130, done.stderr
