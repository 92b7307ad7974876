"""A ``celery worker`` with a lock configuration that can never work stops at start, naming
the setting; one whose lock node is only unreachable now starts and warns. Real worker
processes on a real Redis broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from celery_dlock.testing import free_port

MODULE = """
from celery import Celery
from celery_dlock import SingletonTask

app = Celery("{name}", broker="{broker}")
{settings}


@app.task(base=SingletonTask)
def replicate():
    return 1
"""

#: What a worker's start may take on a busy two-core box before it reads its settings; a
#: worker that starts when it should not is seen by its "ready." line, long before this.
START = 60.0


def worker(
    tmp_path: Path,
    name: str,
    broker: str,
    settings: str,
    *,
    module: bool = True,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    pre_args: tuple[str, ...] = (),
) -> tuple[int | None, str]:
    """Run ``celery -A name worker`` in ``tmp_path`` until it exits or says it is ready; its
    exit status (None: it started, and the test stopped it) and its output. With ``module``,
    ``name``.py is written first: an app on ``broker`` with ``settings`` and a SingletonTask;
    ``env`` adds to the worker's environment, ``pre_args`` go before ``worker`` (``-b``)."""
    if module:
        (tmp_path / f"{name}.py").write_text(
            MODULE.format(name=name, broker=broker, settings=textwrap.dedent(settings))
        )
    log = tmp_path / f"{name}.log"
    command = [
        sys.executable, "-m", "celery", "-A", name, *pre_args, "worker", "-P", "solo", "-l", "INFO",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "--logfile", str(log),
        *args,
    ]  # fmt: skip
    with open(tmp_path / f"{name}.out", "w+b") as out:
        process = subprocess.Popen(
            command,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        deadline = time.monotonic() + START
        try:
            while process.poll() is None:
                if " ready." in (log.read_text(errors="replace") if log.exists() else ""):
                    break
                assert time.monotonic() < deadline, "the worker neither started nor exited"
                time.sleep(0.05)
        finally:
            code = process.poll()
            if code is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        out.seek(0)
        text = out.read().decode(errors="replace")
    return code, text + (log.read_text(errors="replace") if log.exists() else "")


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        pytest.param(
            "app.conf.dlock_urls = ['http://127.0.0.1:6379/0']",
            [
                "dlock_urls: 'http://127.0.0.1:6379/0' has scheme 'http'",
                "zookeeper://",
            ],
            id="bad-scheme",
        ),
        pytest.param(
            "app.conf.dlock_url = ['redis://127.0.0.1:6379/5']\napp.conf.dlock_tll = 5",
            [
                "setting 'dlock_tll' is not a celery_dlock setting (did you mean 'dlock_ttl'?); "
                "setting 'dlock_url' is not a celery_dlock setting (did you mean 'dlock_urls'?)",
            ],
            id="misspelt-settings",
        ),
        pytest.param(
            "app.conf.dlock_ttl = 'thirty'",
            ["dlock_ttl must be a number of seconds, not 'thirty'"],
            id="bad-value",
        ),
    ],
)
def test_a_worker_with_an_impossible_lock_config_exits_at_start_naming_the_setting(
    tmp_path: Path, single_urls: list[str], settings: str, says: list[str]
) -> None:
    code, output = worker(tmp_path, "impossible", single_urls[0], settings)
    assert code not in (None, 0), f"the worker started (status {code}):\n{output[-3000:]}"
    for text in says:
        assert text in output, output[-3000:]
    assert " ready." not in output


def test_a_worker_whose_lock_node_is_unreachable_starts_and_warns(
    tmp_path: Path, single_urls: list[str]
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    settings = f"app.conf.dlock_urls = [{url!r}]"
    code, output = worker(tmp_path, "unreachable", single_urls[0], settings)
    assert code is None, f"the worker exited with status {code}:\n{output[-3000:]}"
    assert f"cannot reach lock node {url}" in output


@pytest.mark.parametrize("how", ["CELERY_BROKER_URL", "celery -b"])
def test_a_worker_whose_broker_comes_from_the_environment_or_b_takes_its_locks_there(
    tmp_path: Path, single_urls: list[str], how: str
) -> None:
    """Celery reads the broker from CELERY_BROKER_URL (and ``celery -b`` sets it), as container
    deployments give it: the locks follow that broker, and the worker is not refused."""
    module = MODULE.format(name="fromenv", broker="", settings="").replace(', broker=""', "")
    (tmp_path / "fromenv.py").write_text(module)  # an app without a broker of its own
    env = {"CELERY_BROKER_URL": single_urls[0]} if how == "CELERY_BROKER_URL" else None
    args = ("-b", single_urls[0]) if how == "celery -b" else ()
    code, output = worker(tmp_path, "fromenv", "", "", module=False, env=env, pre_args=args)
    assert code is None, f"the worker exited with status {code}:\n{output[-3000:]}"
    assert f"locks on {single_urls[0]}" in output, output[-3000:]


BEAT_MODULE = """
from celery import Celery
from celery_dlock import SingletonTask

app = Celery("{name}", broker="{broker}")
app.conf.beat_schedule = {{"often": {{"task": "{name}.replicate", "schedule": 0.5}}}}
{settings}


@app.task(base=SingletonTask)
def replicate():
    return 1
"""


def beat(tmp_path: Path, name: str, broker: str, settings: str) -> tuple[int | None, str]:
    """Run ``celery -A name beat`` until it exits or sends its first task; its exit status
    (None: it sent, and the test stopped it) and its output."""
    (tmp_path / f"{name}.py").write_text(
        BEAT_MODULE.format(name=name, broker=broker, settings=textwrap.dedent(settings))
    )
    log = tmp_path / f"{name}.log"
    command = [
        sys.executable, "-m", "celery", "-A", name, "beat", "-l", "INFO", "--logfile", str(log),
        "-s", str(tmp_path / "schedule"),
    ]  # fmt: skip
    with open(tmp_path / f"{name}.out", "w+b") as out:
        process = subprocess.Popen(
            command, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + START
        try:
            while process.poll() is None:
                if "Sending due task" in (log.read_text(errors="replace") if log.exists() else ""):
                    break
                assert time.monotonic() < deadline, "beat neither sent nor exited"
                time.sleep(0.05)
        finally:
            code = process.poll()
            if code is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        out.seek(0)
        text = out.read().decode(errors="replace")
    return code, text + (log.read_text(errors="replace") if log.exists() else "")


def test_beat_with_an_impossible_lock_config_exits_at_start_naming_the_setting(
    tmp_path: Path, single_urls: list[str]
) -> None:
    """Beat sends the app's SingletonTasks, taking their tick keys (and enqueue-time locks):
    with settings that can never work, each send would fail its lock and go out unlabelled,
    to workers that refuse to start; beat stops at start like them, naming the setting."""
    settings = "app.conf.dlock_url = ['redis://127.0.0.1:6379/5']"
    code, output = beat(tmp_path, "impossiblebeat", single_urls[0], settings)
    assert code not in (None, 0), f"beat started (status {code}):\n{output[-3000:]}"
    assert "setting 'dlock_url' is not a celery_dlock setting" in output, output[-3000:]
    assert "Sending due task" not in output, output[-3000:]


def test_beat_whose_lock_node_is_unreachable_runs(tmp_path: Path, single_urls: list[str]) -> None:
    settings = f"app.conf.dlock_urls = ['redis://127.0.0.1:{free_port()}/0']"
    code, output = beat(tmp_path, "unreachablebeat", single_urls[0], settings)
    assert code is None, f"beat exited with status {code}:\n{output[-3000:]}"


def test_a_worker_that_does_not_use_the_locks_is_not_refused_over_a_lookalike_setting(
    tmp_path: Path,
) -> None:
    """An app without SingletonTasks or dlock settings, on a broker that is not Redis, in a
    process that imports celery_dlock: another library's ``redlock_*`` setting is not ours."""
    (tmp_path / "lookalike.py").write_text(
        "from celery import Celery\n"
        "import celery_dlock  # noqa: F401  (used elsewhere, with URLs of its own)\n"
        "app = Celery('lookalike', broker='memory://')\n"
        "app.conf.redlock_retry_count = 3\n"
        "@app.task\n"
        "def plain():\n"
        "    return 1\n"
    )
    code, output = worker(tmp_path, "lookalike", "", "", module=False)
    assert code is None, f"the worker exited with status {code}:\n{output[-3000:]}"
