"""What a wheel of this tree ships: every package of celery_dlock, and its type marker."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_for_the_wheel() -> None:
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "celery_dlock").rglob("__init__.py")
    }
    assert found == listed, f"pyproject.toml [tool.setuptools] packages should be {sorted(found)}"


def test_the_type_marker_ships() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert data["package-data"]["celery_dlock"] == ["py.typed"]
    assert (ROOT / "celery_dlock" / "py.typed").exists()
