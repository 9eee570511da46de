"""The core must not import a framework: every backend shares it."""

import subprocess
import sys

# Load gradaccum.core without running gradaccum/__init__.py, so that only the core is judged
# (tests/test_without_torch.py imports it through the package, with torch blocked).
CODE = """
import importlib.util, pathlib, sys, types
root = pathlib.Path(importlib.util.find_spec('gradaccum').submodule_search_locations[0])
pkg = types.ModuleType('gradaccum'); pkg.__path__ = [str(root)]
sys.modules['gradaccum'] = pkg
import gradaccum.core
print(','.join(m for m in ('torch', 'mindspore', 'numpy') if m in sys.modules))
"""


def test_core_imports_no_framework():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"gradaccum.core imported {out.stdout.strip()}"


def test_the_check_would_see_torch():
    # The negative twin: importing torch in the same way is detected.
    code = CODE.replace("import gradaccum.core", "import gradaccum.core, torch")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch" in out.stdout
