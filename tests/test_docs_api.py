"""The package's conventions: it ships ``py.typed``, and the API reference (docs/api, built by
``mkdocs build --strict`` in scripts/test.sh, where a warning fails the build) documents every
public name.

"Every public name" is found, not listed: the test walks the package (statically, with griffe,
the reader mkdocstrings itself uses), takes the ``__all__`` of every public module and every
public member of every public class, builds the site once into a temporary folder, and fails on
a name the built reference lacks. The rule for a public module:

* the package ``gradaccum`` and its sub-packages, except those whose name starts with ``_`` and
  the applications (``APPLICATIONS``: the ``gradaccum`` command and what it runs, its run folder
  included, documented as commands in docs/CLI.md, BENCHMARKS.md and SEED_EXPERIMENT.md);
* a package with ``__all__`` re-exports its public names: its modules are its implementation,
  except the core's (``SHARED_FLOOR``), which both adapters import by name;
* a package without ``__all__`` (``gradaccum.integrations``) is a folder: each of its modules is
  imported on its own, so each is a public module.

A name counts as documented when the site's ``objects.inv`` holds it (under this path or under
another path of the same object: ``gradaccum.torch.Accumulator`` is documented as
``gradaccum.Accumulator``); a class's data attribute may instead be a row of the class's
``Attributes`` table, and an inherited member may be documented on the class that defines it.
"""

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gradaccum

griffe = pytest.importorskip("griffe")
mkdocstrings = pytest.importorskip("mkdocstrings")

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(gradaccum.__file__).parent
APPLICATIONS = ("gradaccum.cli", "gradaccum.demos", "gradaccum.run_folder", "gradaccum.bench")
SHARED_FLOOR = ("gradaccum.core",)
# A row of a docstring's Attributes (or Classes, Functions, Modules) table: mkdocstrings-python
# renders its name as an autoref whose title is the member's path (a link once it resolves).
TABLE_ROW = re.compile(r'<tr class="doc-section-item">\s*<td><code><(?:span|a)\b[^>]*?\btitle="([\w.]+)"')


@pytest.fixture(scope="module")
def package():
    return griffe.load("gradaccum", search_paths=[str(SRC.parent)], resolve_aliases=True,
                       resolve_external=False)


# The docs check, as scripts/test.sh runs it. Not ``-q``: mkdocs counts the warnings that fail a
# strict build from what it logs, and ``-q`` logs errors only (a build with warnings exits 0).
DOCS_CHECK = ("mkdocs", "build", "--strict")


def docs_check(root, site):
    """Build the site of the checkout at ``root`` into ``site`` as the docs check does."""
    return subprocess.run([sys.executable, "-m", *DOCS_CHECK, "-d", str(site)], cwd=root,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """What the built site documents: (objects.inv's anchors, the Attributes tables' rows)."""
    site = tmp_path_factory.mktemp("site")
    built = docs_check(ROOT, site)
    warnings = [line for line in built.stderr.splitlines() if "WARNING" in line]
    assert built.returncode == 0 and not warnings, built.stderr
    with open(site / "objects.inv", "rb") as f:
        inventory = mkdocstrings.Inventory.parse_sphinx(f)
    anchors = {item.uri.partition("#")[2] for item in inventory.values() if item.domain == "py"}
    rows = {m for page in (site / "api").rglob("*.html") for m in TABLE_ROW.findall(page.read_text())}
    return anchors, rows


def public_modules(module):
    """``module`` and the public modules under it (the rule in this file's docstring)."""
    if module.path in APPLICATIONS or module.name.startswith("_"):
        return
    yield module
    if module.exports is None or module.path == "gradaccum" or module.path in SHARED_FLOOR:
        for sub in module.modules.values():
            if not sub.is_alias:
                yield from public_modules(sub)


def target(obj):
    return obj.final_target if obj.is_alias else obj


def lookup(package, path):
    """The griffe object at a dotted ``gradaccum...`` path, or None."""
    try:
        return package if path == "gradaccum" else package[path.removeprefix("gradaccum.")]
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def is_data(member):
    return member.is_attribute and "property" not in member.labels


def undocumented(package, anchors, rows):
    """Every public name and public class member that neither ``anchors`` nor ``rows`` hold."""
    documented_as = {}  # canonical path -> the anchor of one page that documents it
    for anchor in sorted(anchors):
        obj = lookup(package, anchor)
        if obj is not None:
            documented_as.setdefault(obj.canonical_path, anchor)
    missing, classes = [], {}
    for module in public_modules(package):
        for name in sorted(module.exports or ()):
            obj = target(module[name])
            anchor = documented_as.get(obj.canonical_path)
            if anchor is None:
                missing.append(f"{module.path}.{name}")
            elif obj.is_class:
                classes[anchor] = obj
    for anchor, cls in sorted(classes.items()):
        for name, member in cls.all_members.items():
            if name.startswith("_"):
                continue
            try:
                member_target = target(member)
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue  # inherited from a class outside gradaccum (torch.nn.Module, ...)
            if not member_target.canonical_path.startswith("gradaccum."):
                continue
            # Documented on this class's page, or (inherited) on the page of the class that
            # defines it: the reference's "Bases:" line links there.
            owner = documented_as.get(member_target.parent.canonical_path)
            paths = {f"{anchor}.{name}"} | ({f"{owner}.{name}"} if owner else set())
            if not paths & (anchors | rows if is_data(member_target) else anchors):
                missing.append(f"{anchor}.{name}")
    return missing


def test_the_package_ships_py_typed():
    assert (SRC / "py.typed").is_file()
    # hatch puts the whole folder in the wheel, py.typed included (nothing excludes files).
    pyproject = (ROOT / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
    assert '[tool.hatch.build.targets.wheel]\npackages = ["src/gradaccum"]\n' in pyproject
    wheel = pyproject.split("[tool.hatch.build.targets.wheel]")[1].split("\n[")[0]
    assert "exclude" not in wheel and "only-include" not in wheel  # (the sdist leaves out data/)


def test_the_gradaccum_page_renders_the_whole_of_all():
    # `::: gradaccum` with no members list renders __all__ (filters: public).
    text = (ROOT / "docs" / "api" / "gradaccum.md").read_text()
    assert re.search(r"^::: gradaccum$", text, re.MULTILINE) and "members:" not in text


def test_the_public_modules_are_found_and_the_applications_exist(package):
    found = {m.path for m in public_modules(package)}
    # Not the list the test checks (that is found), but what the rule must find today.
    assert {"gradaccum", "gradaccum.torch", "gradaccum.core", "gradaccum.core.window",
            "gradaccum.mindspore", "gradaccum.testing", "gradaccum.lightning",
            "gradaccum.integrations.accelerate", "gradaccum.integrations.rl",
            "gradaccum.integrations.lightning"} <= found
    assert not {m for m in found if m.startswith(APPLICATIONS) or "._" in m}
    assert {"gradaccum.torch.check.checker", "gradaccum.torch.memory.oom"}.isdisjoint(found)
    for app in APPLICATIONS:  # a renamed application would make the rule skip nothing
        assert lookup(package, app) is not None, app


def test_the_static_all_is_the_run_time_all(package):
    # griffe reads __all__ from the source; a computed __all__ would be misread.
    compared = set()
    for module in public_modules(package):
        try:
            loaded = importlib.import_module(module.path)
        except ImportError as e:  # an extra that is not installed here (MindSpore)
            assert not (e.name or "").startswith("gradaccum"), e
            continue
        assert sorted(module.exports or ()) == sorted(getattr(loaded, "__all__", ())), module.path
        compared.add(module.path)
    assert {"gradaccum", "gradaccum.torch", "gradaccum.core", "gradaccum.testing"} <= compared


def test_every_public_name_is_in_the_built_reference(package, reference):
    anchors, rows = reference
    missing = undocumented(package, anchors, rows)
    assert not missing, "not in the built reference (docs/api):\n" + "\n".join(missing)


def test_a_name_missing_from_the_reference_is_reported(package, reference):
    anchors, rows = reference
    # The negative twin: the same check, with one module-level name, one method and one data
    # attribute taken out of what the site documents, reports exactly those, and the data
    # attribute once more for the subclass that inherits it (its own page renders the methods).
    taken = {"gradaccum.testing.describe_update", "gradaccum.Accumulator.backward_cached",
             "gradaccum.Accumulator.grad_norm"}
    assert taken <= anchors | rows
    assert sorted(undocumented(package, anchors - taken, rows - taken)) == sorted(
        taken | {"gradaccum.integrations.accelerate.Accumulator.grad_norm"})


def test_a_data_attribute_may_be_a_row_of_its_class_attributes_table(package, reference):
    anchors, rows = reference
    assert "gradaccum.torch.TensorDiff.max_abs" in rows  # the reader still reads the tables
    assert "gradaccum.torch.TensorDiff.max_abs" not in anchors


def test_every_api_page_is_in_the_mkdocs_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert {p for p in pages if p not in nav} == set()


def test_scripts_test_sh_runs_the_docs_check():
    script = (ROOT / "scripts" / "test.sh").read_text()
    builds = [line.split() for line in script.splitlines() if "mkdocs" in line and not line.startswith("#")]
    assert [b[1:] for b in builds] == [list(DOCS_CHECK[1:])], builds
    assert builds[0][0].endswith("/mkdocs")


def test_a_docstring_warning_fails_the_docs_check(tmp_path):
    # In a copy of what the build reads: lr_scale's docstring names a parameter it does not have,
    # which griffe reports as a warning (the kind of mistake that once passed, hidden by -q).
    for part in ("mkdocs.yml", "docs", "src", "scripts/griffe_sphinx_roles.py"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
        copy(ROOT / part, tmp_path / part, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                               if copy is shutil.copytree else {}))
    planted = tmp_path / "src" / "gradaccum" / "core" / "plan.py"
    text = planted.read_text()
    anchor = "        base_lr: the learning rate that works at ``base_batch``.\n"
    assert text.count(anchor) == 1
    planted.write_text(text.replace(anchor, anchor + "        momentum: not a parameter of lr_scale.\n"))
    built = docs_check(tmp_path, tmp_path / "site")
    assert built.returncode != 0, built.stderr
    assert re.search(r"WARNING .*core/plan\.py:\d+: .*'momentum'", built.stderr), built.stderr
