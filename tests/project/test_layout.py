"""The package's folders are its layers: docs/internals.md's two module maps, the folders and
modules on disk, and the import-linter layers contracts in pyproject.toml say the same thing.

A module added, moved or removed without the map and the contract following fails here;
``lint-imports`` then checks that the imports keep to the contracts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter's own dependency reads TOML
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_dlock"
INTERNALS = ROOT / "docs" / "internals.md"

Layers = list[set[str]]


def _table(header: str) -> list[list[str]]:
    """The rows (cells as text) of the internals.md table whose header starts with ``header``."""
    lines = INTERNALS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _names(cell: str) -> set[str]:
    """The module and folder names a cell lists in backquotes, ahead of any explanation in
    parentheses (``beat`` for a module, ``compat/`` for a folder)."""
    cell = re.sub(r"\([^)]*\)", "", cell)
    return set(re.findall(r"`([a-z_]+/?)`", cell))


def _layers(cell: str) -> Layers:
    return [_names(part) for part in cell.split(";")]


def _contracts() -> dict[str, Layers]:
    """Each layers contract's container → its layers, top first (``a | b`` is one layer)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    found = {}
    for contract in contracts:
        if contract["type"] != "layers":
            continue
        (container,) = contract["containers"]
        found[container] = [{n.strip() for n in layer.split("|")} for layer in contract["layers"]]
    return found


def _on_disk(folder: Path) -> set[str]:
    """The modules (``name``) and subpackages (``name/``) directly in ``folder``."""
    names = {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
    names |= {p.name + "/" for p in folder.iterdir() if (p / "__init__.py").is_file()}
    return names


def test_the_package_map_is_the_folders_and_the_contract() -> None:
    rows = _table("layer, from the top")
    mapped = [_names(row[1]) for row in rows]
    assert set().union(*mapped) == _on_disk(PACKAGE)
    contract = _contracts()["celery_dlock"]
    assert [{n.rstrip("/") for n in layer} for layer in mapped] == contract


@pytest.mark.parametrize("row", _table("folder"), ids=lambda row: row[0].strip("`"))
def test_each_folder_map_is_its_modules_and_its_contract(row: list[str]) -> None:
    folder = row[0].strip("`").rstrip("/")
    layers = _layers(row[1])
    assert set().union(*layers) == {n.rstrip("/") for n in _on_disk(PACKAGE / folder)}
    container = "celery_dlock." + folder.replace("/", ".")
    contract = _contracts().get(container)
    if contract is not None:
        assert [{n.rstrip("/") for n in layer} for layer in layers] == contract
    else:  # a folder without a layers contract is listed as one layer
        assert len(layers) == 1


def test_every_folder_has_a_map() -> None:
    mapped = {row[0].strip("`").rstrip("/") for row in _table("folder")}
    folders = {
        str(p.parent.relative_to(PACKAGE))
        for p in PACKAGE.rglob("__init__.py")
        if p.parent != PACKAGE
    }
    assert mapped == folders
