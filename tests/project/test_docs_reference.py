"""The API reference (docs/api.md) is generated from docstrings: every public name has both."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

import celery_dlock

ROOT = Path(__file__).resolve().parents[2]


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mkdocs_hooks", module)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_has_a_docstring_and_a_reference_entry() -> None:
    assert hooks().missing_reference() == []


def test_the_check_names_a_public_name_left_out_of_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = hooks()
    page = tmp_path / "api.md"
    page.write_text(module.API_PAGE.read_text().replace("::: celery_dlock.lock_lost\n", ""))
    monkeypatch.setattr(module, "API_PAGE", page)
    assert module.missing_reference() == [
        "lock_lost: no '::: celery_dlock.lock_lost' entry in docs/api.md"
    ]


def test_the_build_hook_refuses_an_incomplete_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = hooks()
    page = tmp_path / "api.md"
    page.write_text(module.API_PAGE.read_text().replace("::: celery_dlock.Lease\n", ""))
    monkeypatch.setattr(module, "API_PAGE", page)
    with pytest.raises(SystemExit, match="Lease: no"):
        module.on_config({})


def test_the_reference_lists_exactly_the_public_names() -> None:
    entries = set(hooks().ENTRY.findall((ROOT / "docs" / "api.md").read_text()))
    assert entries == set(celery_dlock.__all__)


def test_sphinx_roles_read_as_code() -> None:
    spec = importlib.util.spec_from_file_location(
        "griffe_roles", ROOT / "scripts" / "griffe_roles.py"
    )
    assert spec is not None
    assert spec.loader is not None
    roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roles)
    assert roles.plain("a :class:`~celery_dlock.Holder` or :func:`celery_dlock.lock`") == (
        "a `Holder` or `celery_dlock.lock`"
    )
