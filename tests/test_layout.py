"""The test tree is a package beside src/: tests/torch is ``tests.torch``, never the framework."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent


def resolves_to(name: str, path: list[str]) -> str:
    """Where ``import name`` would load from, in a fresh interpreter with ``path`` before sys.path."""
    code = (f"import importlib.util, sys; sys.path[:0] = {path!r}; "
            f"spec = importlib.util.find_spec({name!r}); print(spec and spec.origin)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_torch_and_mindspore_are_the_frameworks_under_pytest():
    assert TESTS not in Path(torch.__file__).resolve().parents
    spec = importlib.util.find_spec("mindspore")  # None without the optional extra
    assert spec is None or TESTS not in Path(str(spec.origin)).resolve().parents
    assert TESTS not in {Path(p).resolve() for p in sys.path if p}
    assert __name__ == "tests.test_layout"


def test_the_test_folders_would_shadow_them_if_tests_were_on_sys_path():
    # The negative twin: with tests/ on sys.path (the layout this replaced), both names resolve
    # to test folders, which the test above would catch.
    for name in ("torch", "mindspore"):
        assert Path(resolves_to(name, [str(TESTS)])) == TESTS / name / "__init__.py"
