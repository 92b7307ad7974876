"""docs/configuration.md lists every setting and option the code reads, with its default."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from celery import Celery

from celery_dlock import SingletonTask
from celery_dlock.core.config import settings_from_app

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "configuration.md").read_text()
ROW = re.compile(r"^\| `(?P<name>[a-z_]+)` \| (?P<default>[^|]+) \|", re.M)


def table(heading: str) -> dict[str, str]:
    section = PAGE.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return {m["name"]: m["default"].strip() for m in ROW.finditer(section)}


def literal(cell: str) -> Any:
    return ast.literal_eval(cell.strip("`"))


def settings_in_code() -> set[str]:
    found = set()
    for path in (ROOT / "celery_dlock").rglob("*.py"):
        found |= set(re.findall(r"conf\.get\(\s*\"(dlock_[a-z_]+)\"", path.read_text()))
    return found


def test_every_setting_the_code_reads_is_documented_and_nothing_else() -> None:
    assert set(table("App settings")) == settings_in_code()


def test_documented_setting_defaults_are_the_codes() -> None:
    documented = table("App settings")
    app = Celery("reference", set_as_current=False)
    app.conf.dlock_urls = ["redis://127.0.0.1:6379/0"]
    settings = settings_from_app(app)
    for name, field in [
        ("dlock_ttl", "ttl"),
        ("dlock_prefix", "prefix"),
        ("dlock_node_timeout", "node_timeout"),
        ("dlock_drift_factor", "drift_factor"),
        ("dlock_fence_retention", "fence_retention"),
    ]:
        assert literal(documented[name]) == getattr(settings, field), name
    from celery_dlock.celery.beat import LeaderScheduler

    scheduler = LeaderScheduler.__new__(LeaderScheduler)
    scheduler.app = app
    assert scheduler._settings() == ("beat-leader:reference", literal(documented["dlock_beat_ttl"]))


def test_every_singleton_option_is_documented_with_its_default() -> None:
    documented = table("`SingletonTask` options")
    options = {
        name
        for name in vars(SingletonTask)
        if (name.startswith(("lock_", "on_")) and not callable(getattr(SingletonTask, name)))
        or name in ("lock_key", "on_lock_lost")
    }
    options -= {"lock_key_for"}
    assert set(documented) == options
    for name, cell in documented.items():
        assert literal(cell) == getattr(SingletonTask, name), name
