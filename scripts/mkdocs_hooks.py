"""mkdocs hook: the API reference is generated from docstrings, so every public name needs both.

A public name is one in ``celery_dlock.__all__``. The build fails when one has no docstring
(read statically by griffe, as mkdocstrings reads it: a module, class or function docstring, or
the ``#:`` comment / string literal that documents a module attribute) or no ``:::`` entry in
docs/api.md. tests/project/test_docs_reference.py runs the same check without building the site.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
API_PAGE = ROOT / "docs" / "api.md"
ENTRY = re.compile(r"^::: celery_dlock\.(?P<name>\w+)\s*$", re.M)


def missing_reference() -> list[str]:
    """What is wrong with the reference, one line per public name; empty when all is well."""
    import griffe

    habits = griffe.load_extensions(f"{ROOT / 'scripts' / 'griffe_roles.py'}:SphinxHabits")
    package = griffe.load(
        "celery_dlock", search_paths=[str(ROOT)], resolve_aliases=True, extensions=habits
    )
    public = package.members["__all__"].value
    names = [str(item).strip("'\"") for item in public.elements]  # type: ignore[union-attr]
    entries = set(ENTRY.findall(API_PAGE.read_text()))
    problems = []
    for name in names:
        member = package.members.get(name)
        if member is None:
            problems.append(f"{name}: in __all__ but not found by griffe")
            continue
        target = member.final_target if member.is_alias else member  # type: ignore[union-attr]
        if not (target.docstring and target.docstring.value.strip()):
            problems.append(f"{name}: no docstring (the API reference is made from it)")
        if name not in entries:
            problems.append(f"{name}: no '::: celery_dlock.{name}' entry in docs/api.md")
    for extra in sorted(entries - set(names)):
        problems.append(f"{extra}: documented in docs/api.md but not in celery_dlock.__all__")
    return problems


def on_config(config: Any) -> Any:
    problems = missing_reference()
    if problems:
        raise SystemExit("API reference incomplete:\n  " + "\n  ".join(problems))
    return config
