"""torch is needed by the PyTorch API only: ``gradaccum.core`` and ``gradaccum.mindspore`` import
without it, ``import gradaccum`` still works, and a PyTorch name (or the command line) says in one
line what to install. Each check runs in a fresh interpreter where torch cannot be imported."""

import importlib.util
import subprocess
import sys

import pytest

import gradaccum

# Two ways to hide torch: the modules set to None (what `python -c` tests of the extras do), and
# an import hook that refuses torch and every torch.* module (as an environment without torch).
NONE = "import sys; sys.modules['torch'] = None\n"
HOOK = """import importlib.abc, sys
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == 'torch' or name.startswith('torch.'):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoTorch())
"""
BLOCKERS = pytest.mark.parametrize("blocker", [NONE, HOOK], ids=["sys.modules", "meta_path"])
# The torch modules actually loaded (the blocker's None entries are not).
LOADED = ("\nprint(sorted(m for m, v in sys.modules.items() "
          "if v is not None and (m == 'torch' or m.startswith('torch.'))))")


def run(blocker, code):
    return subprocess.run([sys.executable, "-c", blocker + code], capture_output=True, text=True)


@BLOCKERS
def test_the_blocker_hides_torch(blocker):
    # The negative twin of every test below: torch itself cannot be imported.
    out = run(blocker, "import torch")
    assert out.returncode != 0 and "torch" in out.stderr.splitlines()[-1]


@BLOCKERS
def test_gradaccum_core_imports_without_torch(blocker):
    out = run(blocker, "import gradaccum.core\nprint(gradaccum.core.lr_scale(0.1, 32, 128))" + LOADED)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0.4", "[]"]


@BLOCKERS
def test_import_gradaccum_keeps_its_core_names_without_torch(blocker):
    code = ("import gradaccum\nprint(gradaccum.__version__, gradaccum.split_sizes(10, 4), "
            "'Accumulator' in dir(gradaccum))" + LOADED)
    out = run(blocker, code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"{gradaccum.__version__} [4, 4, 2] True", "[]"]


@pytest.mark.skipif(importlib.util.find_spec("mindspore") is None, reason="needs the mindspore extra")
@BLOCKERS
def test_gradaccum_mindspore_imports_without_torch(blocker):
    out = run(blocker, "import gradaccum.mindspore\nprint(gradaccum.mindspore.Accumulator.__name__)" + LOADED)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["Accumulator", "[]"]


@BLOCKERS
@pytest.mark.parametrize("use", ["import gradaccum\ngradaccum.Accumulator",
                                 "from gradaccum import Accumulator", "import gradaccum.torch",
                                 "import gradaccum\ngradaccum.count_tokens",
                                 "import gradaccum\ngradaccum.contrastive",
                                 "from gradaccum.contrastive import clip_loss"])
def test_a_pytorch_name_without_torch_raises_one_line_naming_the_install(blocker, use):
    out = run(blocker, use)
    assert out.returncode == 1
    last = out.stderr.splitlines()[-1]
    assert last.startswith("ImportError: gradaccum's PyTorch API needs torch: pip install torch ("), last


@BLOCKERS
def test_the_command_line_without_torch_prints_one_line_and_exits_2(blocker):
    code = "from gradaccum.cli import main\nraise SystemExit(main(['train', '--backend', 'mindspore']))"
    out = run(blocker, code)
    assert out.returncode == 2
    assert out.stderr.startswith("gradaccum: the command line needs torch: pip install torch (")
    assert len(out.stderr.splitlines()) == 1 and out.stdout == ""


def test_with_torch_the_lazy_names_are_the_torch_adapters_own():
    # Fresh interpreter: nothing has imported gradaccum.torch before these look-ups.
    code = ("import sys, gradaccum\nbefore = 'torch' in sys.modules\n"
            "names = [n for n in gradaccum.__all__ if n != '__version__']\n"
            "import gradaccum.torch as api\n"
            "print(before, all(getattr(gradaccum, n) is getattr(api, n) for n in names if hasattr(api, n)),"
            " gradaccum.torch is api, set(gradaccum.__all__) <= set(dir(gradaccum)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True", "True"]


def test_the_torch_module_is_an_attribute_before_anyone_imports_it():
    code = "import gradaccum\nprint(gradaccum.torch.Accumulator is gradaccum.Accumulator)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr


def test_the_contrastive_module_is_an_attribute_before_anyone_imports_it():
    code = ("import sys, gradaccum\nbefore = 'gradaccum.contrastive' in sys.modules\n"
            "from gradaccum.contrastive import clip_loss\n"
            "print(before, gradaccum.contrastive.clip_loss is clip_loss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'gradaccum' has no attribute 'Acumulator'"):
        gradaccum.Acumulator  # noqa: B018
    assert not hasattr(gradaccum, "Acumulator")
