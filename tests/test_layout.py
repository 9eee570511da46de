"""The test tree is a package beside src/: tests/torch is ``tests.torch``, never the framework.

What holds it there is ours: pyproject.toml's pytest settings (``pythonpath = ["."]``,
``--import-mode=importlib``) and an ``__init__.py`` in every test folder."""

import importlib.util
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent


def test_torch_and_mindspore_are_the_frameworks_under_pytest():
    assert TESTS not in Path(torch.__file__).resolve().parents
    spec = importlib.util.find_spec("mindspore")  # None without the optional extra
    assert spec is None or TESTS not in Path(str(spec.origin)).resolve().parents
    assert TESTS not in {Path(p).resolve() for p in sys.path if p}
    assert __name__ == "tests.test_layout"


def test_every_test_folder_is_a_package():
    # What makes tests/torch ``tests.torch`` under --import-mode=importlib (pyproject.toml):
    # a test folder without __init__.py would be imported by its bare name, as ``torch``.
    folders = {p.parent for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts}
    assert TESTS / "torch" in folders and TESTS / "mindspore" in folders
    assert [f for f in sorted(folders) if not (f / "__init__.py").is_file()] == []
