"""griffe extension for the API reference: the package's docstring habits, read as Markdown.

* Attributes are documented the Sphinx way, by ``#:`` comment lines right above them (class
  options such as ``SingletonTask.lock_ttl``, ``Lease.key``). griffe reads only a string literal
  after the assignment, so an attribute without one gets its ``#:`` lines as its docstring.
* Docstrings use roles such as ``:class:`~celery_dlock.Holder```, which Markdown would show
  literally: each becomes the name it points at, as code (``~`` keeps the last part).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|attr|exc|data|mod|obj):`(?P<tilde>~?)(?P<target>[^`]+)`")


def plain(text: str) -> str:
    """The text with every Sphinx role replaced by inline code of its target."""

    def name(match: re.Match[str]) -> str:
        target = match["target"]
        return f"`{target.rsplit('.', 1)[-1] if match['tilde'] else target}`"

    return ROLE.sub(name, text)


def comment_above(lines: list[str], lineno: int) -> str | None:
    """The ``#:`` comment block right above line ``lineno`` (1-based), without the markers."""
    found: list[str] = []
    index = lineno - 2
    while index >= 0 and lines[index].strip().startswith("#:"):
        found.append(lines[index].strip()[2:].strip())
        index -= 1
    return " ".join(reversed(found)) or None


class SphinxHabits(griffe.Extension):
    """Gives ``#:``-documented attributes their docstring and rewrites roles in every docstring."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is None and attr.lineno is not None:
            try:
                lines = list(attr.lines_collection[attr.filepath])  # type: ignore[index]
            except (KeyError, TypeError):
                return
            text = comment_above(lines, attr.lineno)
            if text:
                attr.docstring = griffe.Docstring(plain(text), parent=attr)

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
