"""Collection rules for the whole suite (pytest reads this before anything else)."""

import importlib.util

# Modules that import MindSpore need the optional extra; without it, skip their doctests rather
# than fail collection (the tests under tests/mindspore skip themselves with importorskip; the
# helper modules beside them import MindSpore at the top).
collect_ignore_glob = [] if importlib.util.find_spec("mindspore") else [
    "src/gradaccum/mindspore/*",
    "src/gradaccum/demos/mindspore_*.py",
    "tests/mindspore_reference.py",
    "tests/mindspore/dp_ranks.py",
]
