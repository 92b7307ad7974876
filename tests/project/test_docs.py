"""Every Python example in docs/ runs, against real Redis, with its assertions.

Blocks of one page run in order in one namespace. ``redis://127.0.0.1:63NN/D`` in the text is
mapped to this suite's servers (6379 -> the first Redlock server, 6380 -> the second, ...), so
the examples read like a user's while testing real behaviour. Tasks run eagerly unless the block
is preceded by ``<!-- test: not eager -->`` (it publishes to the broker, with no worker).

Where eager runs would hide what a user meets (serialization, a result crossing processes), a
page marks the blocks that define its app and tasks ``<!-- test: worker module -->`` and the
blocks that use them ``<!-- test: worker -->``: the module blocks also become a module a real
``celery worker`` (prefork) imports, and the worker blocks publish to it.

Blocks marked ``<!-- test: topology NAME -->`` need a Sentinel group or a cluster; the tests of
that topology run them (:func:`topology_examples`). Blocks marked ``<!-- test: quickstart
... -->`` are the quick start's, run as written by tests/project/test_quickstart.py; ``<!-- test:
django ... -->`` ones are a Django project's files, run by tests/celery/test_django.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_dlock.backends.zookeeper import close_all as zk_close_all
from celery_dlock.testing import terminate
from tests.support.clients import client
from tests.support.zookeeper import skip_reason as zk_skip_reason
from tests.support.zookeeper import standalone

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"(<!-- test: (?P<mark>[^>]*) -->\s*)?```python\n(?P<code>.*?)```", re.S)
URL = re.compile(r"redis://127\.0\.0\.1:(63\d\d)")
#: ``zookeeper://127.0.0.1:2181`` in a page: mapped to this suite's standalone ZooKeeper.
ZK_URL = re.compile(r"zookeeper://127\.0\.0\.1:2181")


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


class DocsWorker:
    """A real prefork ``celery worker`` importing a page's ``worker module`` blocks."""

    def __init__(self, page: Path, directory: Path) -> None:
        self.module = f"docs.{page.stem}"  # the name the page's namespace runs under
        self.directory = directory
        self.sources: list[str] = []
        self.process: subprocess.Popen[bytes] | None = None

    def add(self, code: str) -> None:
        assert self.process is None, "a worker module block after a worker block"
        self.sources.append(code)

    def ensure_started(self) -> None:
        if self.process is not None:
            return
        package = self.directory / "docs"
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text("")
        (package / f"{self.module.split('.')[1]}.py").write_text("\n\n".join(self.sources))
        log = self.directory / "worker.log"
        env = {**os.environ, "PYTHONPATH": f"{self.directory}{os.pathsep}{ROOT}"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", self.module, "worker", "-P", "prefork",
             "-c", "2", "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-l", "INFO", "--logfile", str(log)],
            cwd=self.directory, env=env, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while "ready." not in (log.read_text() if log.exists() else ""):
            assert self.process.poll() is None, f"worker exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"worker not ready: {log.read_text()}"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def zk_docs_hosts() -> Iterator[str]:
    """A standalone ZooKeeper for the pages that name ``zookeeper://127.0.0.1:2181``."""
    reason = zk_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with standalone() as server:
        yield server.hosts
        zk_close_all()  # before the server stops: no client left retrying a dead server


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_examples_run(
    page: Path, redlock_session_urls: list[str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    servers = {6379 + i: url.rsplit("/", 1)[0] for i, url in enumerate(redlock_session_urls)}
    for base in servers.values():
        client(base + "/0").flushall()
    namespace: dict[str, object] = {"__name__": f"docs.{page.stem}"}
    text = page.read_text()
    if ZK_URL.search(text):
        zk_hosts = request.getfixturevalue("zk_docs_hosts")
        text = ZK_URL.sub(f"zookeeper://{zk_hosts}", text)
    blocks = list(BLOCK.finditer(text))
    worker = DocsWorker(page, tmp_path)
    try:
        for number, block in enumerate(blocks, 1):
            mark = block.group("mark") or ""
            if mark.startswith(("topology", "quickstart", "django", "project")):
                # Needs a Sentinel group or a cluster (run by that topology's tests), or is a
                # file of the quick start (tests/project/test_quickstart.py runs it as written), of
                # the Django example (tests/celery/test_django.py runs it with Django) or of
                # examples/testing_project (tests/project/test_testing_project.py checks and runs
                # it).
                continue
            code = URL.sub(lambda m: servers[int(m.group(1))], block.group("code"))
            if mark == "worker module":
                worker.add(code)
            elif mark == "worker":
                worker.ensure_started()
            app = namespace.get("app")
            if app is not None:
                eager = mark not in ("not eager", "worker", "worker module")
                app.conf.task_always_eager = eager  # type: ignore[attr-defined]
            try:
                exec(compile(code, f"{page.name} block {number}", "exec"), namespace)
            except Exception as exc:
                raise AssertionError(
                    f"{page.name}, example {number} failed: {exc!r}\n{code}"
                ) from exc
    finally:
        worker.stop()


def test_docs_have_examples() -> None:
    assert sum(len(BLOCK.findall(p.read_text())) for p in pages()) >= 8


def test_the_test_layout_table_names_every_folder_of_tests() -> None:
    """docs/internals.md's "Test layout" table lists each folder of tests/ that holds test
    files, and tests/support/, and no other folder."""
    page = (DOCS / "internals.md").read_text()
    assert "\n## Test layout\n" in page, "docs/internals.md has no '## Test layout' section"
    section = page.split("\n## Test layout\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(tests/[^`]*)/` \|", section, re.M))
    tests = ROOT / "tests"
    holding = {
        path.parent.relative_to(ROOT).as_posix()
        for path in tests.rglob("test_*.py")
        if "support" not in path.relative_to(tests).parts
    }
    assert listed == holding | {"tests/support"}


def topology_examples(name: str) -> list[str]:
    """The code of the docs blocks marked ``<!-- test: topology NAME -->``."""
    found = []
    for page in pages():
        for block in BLOCK.finditer(page.read_text()):
            if block.group("mark") == f"topology {name}":
                found.append(block.group("code"))
    return found
