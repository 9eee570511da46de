"""Collection rules for the whole suite (pytest reads this before anything else)."""

import importlib.util


def _has_mindspore() -> bool:
    # The real package, not a bare namespace (tests/mindspore is on sys.path); nothing imported.
    spec = importlib.util.find_spec("mindspore")
    return spec is not None and spec.origin is not None


# The MindSpore modules' doctests need the optional extra; without it, skip them rather than
# fail collection (the tests under tests/mindspore skip themselves with importorskip; the helper
# modules beside them import MindSpore at the top).
collect_ignore_glob = [] if _has_mindspore() else [
    "src/gradaccum/mindspore/*",
    "src/gradaccum/demos/mindspore_*.py",
    "tests/mindspore_reference.py",
    "tests/mindspore/dp_ranks.py",
]
