"""The shape of the package: no import cycle, floors that never import upwards, rooms that import
only what their docstrings name, a lean ``import gradaccum``, and every public name of 0.1.0 (and
the Lightning mixin's of 0.3.0) still importable. Module sizes are a printed report
(scripts/module_report.py), not a gate."""

import ast
import importlib
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import gradaccum

grimp = pytest.importorskip("grimp")

SRC = Path(gradaccum.__file__).parent
# Lower floors never import higher ones: core < torch < run_folder < demos < cli, mindspore < demos,
# bench < cli.
FLOORS = [("gradaccum.core", "gradaccum.torch"), ("gradaccum.core", "gradaccum.mindspore"),
          ("gradaccum.core", "gradaccum.demos"), ("gradaccum.core", "gradaccum.bench"),
          ("gradaccum.core", "gradaccum.cli"), ("gradaccum.torch", "gradaccum.mindspore"),
          ("gradaccum.torch", "gradaccum.demos"), ("gradaccum.torch", "gradaccum.bench"),
          ("gradaccum.torch", "gradaccum.cli"), ("gradaccum.mindspore", "gradaccum.torch"),
          ("gradaccum.mindspore", "gradaccum.demos"), ("gradaccum.mindspore", "gradaccum.cli"),
          ("gradaccum.demos", "gradaccum.cli"), ("gradaccum.bench", "gradaccum.cli"),
          # The integrations and the test helper sit on the public API: nothing below them imports
          # them, and they import no command, demo or benchmark. Lightning's mixin is checked at its
          # home, gradaccum.integrations.lightning, and at its 0.3.0 path, gradaccum.lightning,
          # which the integrations never import (it sits on top of them).
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
            for low in ("gradaccum.core", "gradaccum.torch", "gradaccum.mindspore")],
          # The mixture-of-experts balance sits at the torch floor, as the contrastive losses do.
          *[("gradaccum.moe", high) for high in (
              "gradaccum.mindspore", "gradaccum.demos", "gradaccum.bench", "gradaccum.cli",
              "gradaccum.integrations", "gradaccum.lightning", "gradaccum.testing",
              "gradaccum.contrastive")],
          *[(low, "gradaccum.moe") for low in (
              "gradaccum.core", "gradaccum.torch", "gradaccum.mindspore", "gradaccum.contrastive")],
          # The run folder (lock, checkpoint, outputs, interrupts) sits below the seed experiment
          # and the commands, which import it, and above the core and the adapter: it imports no
          # demo, command, benchmark, backend or integration, and no library room imports it.
          *[("gradaccum.run_folder", high) for high in (
              "gradaccum.demos", "gradaccum.cli", "gradaccum.bench", "gradaccum.mindspore",
              "gradaccum.integrations", "gradaccum.lightning", "gradaccum.testing")],
          *[(low, "gradaccum.run_folder") for low in (
              "gradaccum.core", "gradaccum.torch", "gradaccum.contrastive", "gradaccum.mindspore",
              "gradaccum.integrations", "gradaccum.lightning", "gradaccum.testing")],
          ("gradaccum.integrations", "gradaccum.lightning")]
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
LIGHTNING_0_3_0 = ["AccumulatorMixin", "CHECKPOINT_KEY"]
# The rooms: the top-level packages. Each docstring has one paragraph "May import: gradaccum.core,
# gradaccum.torch" (or "May import: no other part of gradaccum") naming the rooms it may import;
# the root package ``gradaccum`` (its version) is open to every room.
ROOMS = sorted(f"gradaccum.{p.parent.name}" for p in SRC.glob("*/__init__.py"))


def may_import(room):
    """The rooms that ``room``'s docstring says it may import (read from the source: importing
    gradaccum.mindspore needs MindSpore)."""
    source = SRC.joinpath(*room.split(".")[1:], "__init__.py").read_text()
    doc = ast.get_docstring(ast.parse(source)) or ""
    found = re.findall(r"^May import: (.+?)(?:\n\n|\Z)", doc, re.MULTILINE | re.DOTALL)
    lines = [" ".join(line.split()) for line in found]
    assert len(lines) == 1, f"{room}: its docstring needs one paragraph 'May import: ...', has {lines}"
    named = set() if lines[0] == "no other part of gradaccum" else set(lines[0].split(", "))
    assert named <= set(ROOMS) - {room}, f"{room}: 'May import: {lines[0]}' names what is not a room"
    return named


def floors_broken(declared):
    """The FLOORS pairs (low, high) with high among what low may import, directly or through a
    room it may import."""
    broken = []
    for low, high in FLOORS:
        reach, todo = set(), [low]
        while todo:
            for room in declared.get(todo.pop(), ()):
                if room not in reach:
                    reach.add(room)
                    todo.append(room)
        if high in reach:
            broken.append((low, high))
    return broken


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


def test_every_room_names_what_it_may_import_and_imports_nothing_else(graph):
    assert {"gradaccum.core", "gradaccum.torch", "gradaccum.integrations", "gradaccum.run_folder",
            "gradaccum.demos", "gradaccum.cli", "gradaccum.moe"} <= set(ROOMS)
    for room in ROOMS:
        modules = {room} | graph.find_descendants(room)
        imported = {".".join(i.split(".")[:2])
                    for m in modules for i in graph.find_modules_directly_imported_by(m)}
        unnamed = imported - {room, "gradaccum"} - may_import(room)
        assert not unnamed, f"{room} imports {sorted(unnamed)}, which its 'May import:' does not name"


def test_what_the_rooms_may_import_keeps_the_floors():
    declared = {room: may_import(room) for room in ROOMS}
    assert floors_broken(declared) == []
    # The negative twin: the adapter allowed the demos breaks the floors between the adapter (and
    # the rooms on it) and the demos, and what the demos may import.
    declared["gradaccum.torch"] = declared["gradaccum.torch"] | {"gradaccum.demos"}
    assert {("gradaccum.torch", "gradaccum.demos"), ("gradaccum.torch", "gradaccum.mindspore"),
            ("gradaccum.torch", "gradaccum.run_folder"), ("gradaccum.contrastive", "gradaccum.demos"),
            ("gradaccum.integrations", "gradaccum.demos")} <= set(floors_broken(declared))


def test_import_gradaccum_needs_neither_tqdm_nor_matplotlib():
    # torch.hub imports tqdm when it is installed, so blocking them is the test: with both
    # unimportable, import gradaccum must still work and load no command or demo module.
    code = ("import sys; sys.modules['tqdm'] = None; sys.modules['matplotlib'] = None; "
            "import gradaccum, gradaccum.torch; "
            "print(sorted(m for m in sys.modules if m.startswith(('gradaccum.cli', 'gradaccum.demos', "
            "'gradaccum.run_folder', 'gradaccum.bench', 'gradaccum.mindspore'))))")
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


def test_every_lightning_name_of_0_3_0_imports_from_its_home_and_its_old_path():
    import gradaccum.integrations.lightning as home
    import gradaccum.lightning as old
    from gradaccum.integrations.lightning import _checkpoint, mixin

    assert set(LIGHTNING_0_3_0) <= set(old.__all__) and set(LIGHTNING_0_3_0) <= set(home.__all__)
    # Compared with the modules that define them, so that no name is compared with itself.
    origins = {"AccumulatorMixin": mixin, "CHECKPOINT_KEY": _checkpoint}
    for name in LIGHTNING_0_3_0:
        assert getattr(old, name) is getattr(home, name) is getattr(origins[name], name)


def test_the_version_is_written_once():
    pyproject = (SRC.parents[1] / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and "\nversion =" not in pyproject
