"""Settings from Django (``config_from_object("django.conf:settings", namespace="CELERY")``),
with real Django: docs/configuration.md's example runs in a real worker, and a setting
Celery would not read is reported in the spelling the user writes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.celery.test_worker_config import worker

pytest.importorskip("django", reason="Django is not installed (the test extra has it)")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"
BLOCK = re.compile(r"<!-- test: django (?P<path>\S+) -->\s*```python\n(?P<code>.*?)```", re.S)

TASKS = """
from celery_dlock import SingletonTask

from proj.celery import app


@app.task(base=SingletonTask, bind=True)
def replicate(self):
    return [self.lease.key, self.lease.valid_for]
"""


def project(tmp_path: Path, redis_url: str, *, extra: str = "", replace: str = "") -> Path:
    """The docs' Django project in ``tmp_path`` on this suite's Redis, with a task module,
    ``extra`` lines added to settings.py and ``replace`` naming a line to drop."""
    base = redis_url.rsplit("/", 1)[0]
    blocks = {m.group("path"): m.group("code") for m in BLOCK.finditer(PAGE.read_text())}
    assert set(blocks) == {"proj/settings.py", "proj/celery.py"}, blocks.keys()
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    for path, block in blocks.items():
        text = block.replace("redis://127.0.0.1:6379", base)
        if path.endswith("settings.py"):
            lines = [line for line in text.splitlines() if not (replace and replace in line)]
            text = "\n".join([*lines, extra, ""])
        (tmp_path / path).write_text(text)
    (tmp_path / "proj" / "tasks.py").write_text(TASKS)
    return tmp_path


def python(cwd: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{cwd}{os.pathsep}{ROOT}"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


def test_the_docs_django_example_takes_its_locks_where_its_settings_say(
    tmp_path: Path, single_urls: list[str]
) -> None:
    root = project(tmp_path, single_urls[0])
    base = single_urls[0].rsplit("/", 1)[0]
    done = python(
        root,
        "from proj.celery import app\n"
        "from celery_dlock.core.config import settings_from_app\n"
        "s = settings_from_app(app)\n"
        "print(s.urls, s.ttl, s.prefix)\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"('{base}/1',)", "60.0", "myproj-dlock"], done.stdout
    # A real worker of the project runs a SingletonTask under a lock in db 1.
    code, output = worker(
        root, "proj", single_urls[0], "", module=False, args=("--include", "proj.tasks")
    )
    assert code is None, output[-3000:]
    assert f"locks on {base}/1" in output, output[-3000:]


@pytest.mark.parametrize(
    ("extra", "replace", "says"),
    [
        pytest.param(
            'CELERY_DLOCK_URL = ["redis://127.0.0.1:6379/5"]',
            "CELERY_DLOCK_URLS",
            "setting 'CELERY_DLOCK_URL' is not a celery_dlock setting "
            "(did you mean 'CELERY_DLOCK_URLS'?)",
            id="misspelt",
        ),
        pytest.param(
            'DLOCK_URLS = ["redis://127.0.0.1:6379/5"]',
            "CELERY_DLOCK_URLS",
            "setting 'DLOCK_URLS' is ignored: this app reads its settings with "
            "namespace='CELERY', so Celery looks for 'CELERY_DLOCK_URLS'",
            id="no-prefix",
        ),
        pytest.param(
            "CELERY_DLOCK_TLL = 5",
            "",
            "setting 'CELERY_DLOCK_TLL' is not a celery_dlock setting "
            "(did you mean 'CELERY_DLOCK_TTL'?)",
            id="misspelt-ttl",
        ),
    ],
)
def test_a_django_setting_celery_would_not_read_stops_the_worker_naming_it_as_written(
    tmp_path: Path, single_urls: list[str], extra: str, replace: str, says: str
) -> None:
    base = single_urls[0].rsplit("/", 1)[0]
    extra = extra.replace("redis://127.0.0.1:6379", base)
    root = project(tmp_path, single_urls[0], extra=extra, replace=replace)
    code, output = worker(
        root, "proj", single_urls[0], "", module=False, args=("--include", "proj.tasks")
    )
    assert code not in (None, 0), f"the worker started (status {code}):\n{output[-3000:]}"
    assert says in output, output[-3000:]
    # `celery dlock check` says the same, before any worker starts.
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{ROOT}"}
    checked = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "proj", "dlock", "check"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert says in checked.stderr, checked.stdout + checked.stderr
