"""A benchmark script's results file: the JSON its page's numbers bind to (tests/test_doc_numbers.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["write_results"]


def write_results(path: Path, results: dict[str, Any], *, indent: int = 1,
                  default: Callable[[Any], Any] | None = None) -> None:
    """Write ``results`` to ``path`` as JSON (its folder made if missing), ending in a newline.

    Args:
        path: the results file, e.g. ``docs/results/NAME.json``.
        results: the measured numbers, with the machine that measured them.
        indent: JSON indentation.
        default: ``json.dumps``'s ``default`` for values it cannot write (e.g. ``str``).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     write_results(Path(tmp) / "new" / "r.json", {"ratio": 1.0})
        ...     (Path(tmp) / "new" / "r.json").read_text()
        '{\\n "ratio": 1.0\\n}\\n'
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=indent, default=default) + "\n")
