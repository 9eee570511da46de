"""A griffe extension for the API reference (mkdocs.yml): the project's docstrings as griffe reads them.

Two habits of the docstrings that griffe's Google-style parser would otherwise misread:

- cross-references written as Sphinx roles (``:func:`parse_schedule```), which Markdown shows
  verbatim: each becomes inline code (```parse_schedule```); a leading ``~`` (Sphinx's "last
  component only") keeps the last dotted component;
- the ``Example:`` section (singular), which griffe takes for an admonition and renders as text,
  so that ``[4, 4, 2, 2]`` under a ``>>>`` line reads as a Markdown link: it is read as
  ``Examples:``, whose ``>>>`` lines griffe renders as code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")
EXAMPLE = re.compile(r"^Example:[ \t]*$", re.MULTILINE)  # griffe has dedented the docstring


def _code(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring griffe loads, before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = EXAMPLE.sub("Examples:", ROLE.sub(_code, obj.docstring.value))
