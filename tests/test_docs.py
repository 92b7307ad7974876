"""Every Python example in docs/ runs, against real Redis, with its assertions.

Blocks of one page run in order in one namespace. ``redis://127.0.0.1:63NN/D`` in the text is
mapped to this suite's servers (6379 -> the first Redlock server, 6380 -> the second, ...), so
the examples read like a user's while testing real behaviour. Tasks run eagerly unless the block
is preceded by ``<!-- test: not eager -->`` (it publishes to the broker, with no worker).
Blocks marked ``<!-- test: topology NAME -->`` need a Sentinel group or a cluster; the tests of
that topology run them (:func:`topology_examples`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.clients import client

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"(<!-- test: (?P<mark>[^>]*) -->\s*)?```python\n(?P<code>.*?)```", re.S)
URL = re.compile(r"redis://127\.0\.0\.1:(63\d\d)")


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_examples_run(page: Path, redlock_session_urls: list[str]) -> None:
    servers = {6379 + i: url.rsplit("/", 1)[0] for i, url in enumerate(redlock_session_urls)}
    for base in servers.values():
        client(base + "/0").flushall()
    namespace: dict[str, object] = {"__name__": f"docs.{page.stem}"}
    blocks = list(BLOCK.finditer(page.read_text()))
    for number, block in enumerate(blocks, 1):
        if (block.group("mark") or "").startswith("topology"):
            continue  # needs a Sentinel group or a cluster: run by that topology's tests
        code = URL.sub(lambda m: servers[int(m.group(1))], block.group("code"))
        app = namespace.get("app")
        if app is not None:
            app.conf.task_always_eager = block.group("mark") != "not eager"  # type: ignore[attr-defined]
        try:
            exec(compile(code, f"{page.name} block {number}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"{page.name}, example {number} failed: {exc!r}\n{code}") from exc


def test_docs_have_examples() -> None:
    assert sum(len(BLOCK.findall(p.read_text())) for p in pages()) >= 8


def topology_examples(name: str) -> list[str]:
    """The code of the docs blocks marked ``<!-- test: topology NAME -->``."""
    found = []
    for page in pages():
        for block in BLOCK.finditer(page.read_text()):
            if block.group("mark") == f"topology {name}":
                found.append(block.group("code"))
    return found
