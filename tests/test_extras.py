"""The MindSpore extra is optional: ``import gradaccum`` never needs it, and without it
``import gradaccum.mindspore`` says which extra to install."""

import subprocess
import sys

# Run in a fresh interpreter where the mindspore package cannot be imported.
HIDE = "import sys; sys.modules['mindspore'] = None\n"


def run(code):
    return subprocess.run([sys.executable, "-c", HIDE + code], capture_output=True, text=True)


def test_import_gradaccum_does_not_import_mindspore():
    out = run("import gradaccum, gradaccum.cli, gradaccum.demos; print('ok')")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_gradaccum_mindspore_names_the_extra_when_mindspore_is_missing():
    out = run("import gradaccum.mindspore")
    assert out.returncode != 0
    assert "ImportError: gradaccum.mindspore needs MindSpore" in out.stderr
    assert "pip install 'gradaccum[mindspore]'" in out.stderr
