"""griffe extension for the API reference: Sphinx roles in docstrings read as inline code.

The package's docstrings use the ``:class:`~celery_dlock.Holder``` spelling Python developers
read in their editors; mkdocstrings renders docstrings as Markdown, where the role would show
literally. This turns each role into the name it points at, as code (``~`` keeps the last part).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|attr|exc|data|mod|obj):`(?P<tilde>~?)(?P<target>[^`]+)`")


def plain(text: str) -> str:
    def name(match: re.Match[str]) -> str:
        target = match["target"]
        return f"`{target.rsplit('.', 1)[-1] if match['tilde'] else target}`"

    return ROLE.sub(name, text)


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
