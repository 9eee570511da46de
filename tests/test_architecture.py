"""The shape of the package: no import cycle, floors that never import upwards, a lean
``import gradaccum``, and every public name of 0.1.0 still importable. Module sizes are a
printed report (scripts/module_report.py), not a gate."""

import ast
import importlib
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import gradaccum

grimp = pytest.importorskip("grimp")

SRC = Path(gradaccum.__file__).parent
# Lower floors never import higher ones: core < torch, mindspore < demos, bench < cli.
FLOORS = [("gradaccum.core", "gradaccum.torch"), ("gradaccum.core", "gradaccum.mindspore"),
          ("gradaccum.core", "gradaccum.demos"), ("gradaccum.core", "gradaccum.bench"),
          ("gradaccum.core", "gradaccum.cli"), ("gradaccum.torch", "gradaccum.mindspore"),
          ("gradaccum.torch", "gradaccum.demos"), ("gradaccum.torch", "gradaccum.bench"),
          ("gradaccum.torch", "gradaccum.cli"), ("gradaccum.mindspore", "gradaccum.torch"),
          ("gradaccum.mindspore", "gradaccum.demos"), ("gradaccum.mindspore", "gradaccum.cli"),
          ("gradaccum.demos", "gradaccum.cli"), ("gradaccum.bench", "gradaccum.cli"),
          # The integrations, Lightning and the test helper sit on the public API: nothing below
          # them imports them, and they import no command, demo or benchmark.
          *[(low, high) for high in ("gradaccum.integrations", "gradaccum.lightning", "gradaccum.testing")
            for low in ("gradaccum.core", "gradaccum.torch", "gradaccum.mindspore")],
          *[(low, high) for low in ("gradaccum.integrations", "gradaccum.lightning", "gradaccum.testing")
            for high in ("gradaccum.cli", "gradaccum.demos", "gradaccum.bench")],
          # The tiled contrastive losses sit at the torch floor: they import the core and the
          # adapter, nothing above; the core, the adapter and MindSpore never import them.
          *[("gradaccum.contrastive", high) for high in (
              "gradaccum.mindspore", "gradaccum.demos", "gradaccum.bench", "gradaccum.cli",
              "gradaccum.integrations", "gradaccum.lightning", "gradaccum.testing")],
          *[(low, "gradaccum.contrastive")
            for low in ("gradaccum.core", "gradaccum.torch", "gradaccum.mindspore")]]
PUBLIC_0_1_0 = [
    "Accumulator", "AutoBatch", "CheckReport", "MemoryEstimate", "MicroBatch", "NoMicroBatchFitsError",
    "Schedule", "WindowBatchNorm", "__version__", "batch_size", "check_batch_sizes", "check_equivalence",
    "is_oom_error", "lr_scale", "parse_schedule", "resolve_batch_sizes", "restore_batchnorm",
    "restore_momentum_", "scale_momentum_", "scaled_momentum", "split_batch", "split_sizes",
    "to_groupnorm", "to_window_batchnorm", "window_batchnorm",
]
TORCH_0_1_0 = [
    "Accumulator", "AutoBatch", "CheckReport", "Hazard", "MicroBatch", "NoMicroBatchFitsError",
    "TensorDiff", "WindowBatchNorm", "batch_size", "check_equivalence", "is_oom_error",
    "restore_batchnorm", "restore_momentum_", "scale_momentum_", "split_batch", "to_groupnorm",
    "to_window_batchnorm", "window_batchnorm",
]


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("gradaccum")


def test_no_import_cycle_counting_lazy_imports(graph):
    cycles = []
    for importer in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(importer):
            if graph.chain_exists(importer=imported, imported=importer):
                cycles.append((*graph.find_shortest_chain(importer=imported, imported=importer), imported))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("low, high", FLOORS)
def test_a_lower_floor_never_imports_a_higher_one(graph, low, high):
    assert not graph.chain_exists(importer=low, imported=high, as_packages=True), \
        graph.find_shortest_chains(importer=low, imported=high, as_packages=True)


def test_import_gradaccum_needs_neither_tqdm_nor_matplotlib():
    # torch.hub imports tqdm when it is installed, so blocking them is the test: with both
    # unimportable, import gradaccum must still work and load no command or demo module.
    code = ("import sys; sys.modules['tqdm'] = None; sys.modules['matplotlib'] = None; "
            "import gradaccum, gradaccum.torch; "
            "print(sorted(m for m in sys.modules if m.startswith(('gradaccum.cli', 'gradaccum.demos', "
            "'gradaccum.bench', 'gradaccum.mindspore'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_accumulator_defines_every_public_method_itself():
    # No mixin, and no method a subclass fills in: a reader of accumulator.py sees all of it.
    from gradaccum.torch.accumulator import Accumulator

    assert Accumulator.__bases__ == (object,)
    public = [name for name in dir(Accumulator) if not name.startswith("_")]
    assert "backward_cached" in public and "state_dict" in public
    assert [name for name in public if name not in vars(Accumulator)] == []


def test_no_module_reads_or_writes_an_accumulators_private_attributes():
    # The parts are given what they need (torch/accumulator.py's docstring): outside that file, no
    # attribute of another object (not self) bears the name of one of an Accumulator's private
    # attributes or methods, and no getattr/setattr/hasattr names one.
    import torch

    acc = gradaccum.Accumulator(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), 1)
    private = {k for k in [*vars(acc), *dir(type(acc))] if k.startswith("_") and not k.startswith("__")}
    assert {"_window", "_precision", "_sync", "_commit"} <= private
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "torch" / "accumulator.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value in private):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_the_module_report_lists_every_module(capsys):
    report = runpy.run_path(str(SRC.parents[1] / "scripts" / "module_report.py"))
    lines = report["module_lines"]()
    assert set(lines) == {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")}
    text = report["report"](lines, over=10**6)
    assert "torch/accumulator.py" not in text and "  accumulator.py" in text  # per folder
    assert text.endswith(f"total: {len(lines)} modules, {sum(lines.values())} lines; 0 over 1000000")


def test_every_public_name_of_0_1_0_still_imports():
    import gradaccum.torch

    assert set(PUBLIC_0_1_0) <= set(gradaccum.__all__)
    for name in PUBLIC_0_1_0:
        assert getattr(gradaccum, name) is not None
    # Hazard and TensorDiff are not top-level names: compared with their defining modules, so
    # that no name is compared with itself.
    origins = {"Hazard": "gradaccum.torch.check.hazards", "TensorDiff": "gradaccum.torch.check.report"}
    for name in TORCH_0_1_0:
        home = importlib.import_module(origins[name]) if name in origins else gradaccum
        assert getattr(gradaccum.torch, name) is getattr(home, name)


def test_the_version_is_written_once():
    pyproject = (SRC.parents[1] / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and "\nversion =" not in pyproject
