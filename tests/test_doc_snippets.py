"""Every ```python block of README.md and docs/**/*.md runs (the convention: docs/TESTING.md,
"The code on these pages runs").

Pages are found by glob, so a new page is covered the day it is written. A page's blocks run in
order, each in a fresh namespace and a fresh working folder that holds the page's files, so
that a block copied alone runs as the page says: it may use what an earlier block defined or
saved only where its first line says so, ``# continues the block above`` (it then runs in that
block's namespace and folder). A block is, by what is written beside it in the page:

* run as printed, or after its hidden glue: an HTML comment ``<!-- setup: ... -->`` right above
  it holding Python that defines what the prose assumes (``model``, ``loader``, small sizes);
* a file (``<!-- file: mylm.py -->``): written to the working folder, where later blocks import it;
* followed by an ``<!-- output -->`` block: what it prints, line for line;
* expected to raise (``<!-- raises: ValueError -->``): and a ``# ValueError: ...`` comment in the
  block must be the start of the message;
* a recipe (``<!-- recipe: name -->``): executed by its own test, which must name it;
* marked ``# needs: KIND why`` on its first line (a GPU, several processes): not run here, and
  listed by ``test_the_blocks_that_cannot_run_here``.
"""

import contextlib
import importlib
import io
import linecache
import random
import re
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[ \t]*\n(?P<code>.*?)^```[ \t]*$", re.S | re.M)
COMMENT_ABOVE = re.compile(r"<!--(?P<body>(?:(?!<!--).)*?)-->\s*\Z", re.S)
NEEDS = re.compile(r"\A# needs: (?P<kind>\w+)\b(?P<why>.*)\n")
CONTINUES = re.compile(r"\A# continues the block above\b")
# The optional frameworks a page may use: without one installed, its page is skipped (and listed).
EXTRAS = {"mindspore", "transformers", "accelerate", "pytorch_lightning", "lightning"}
# What a `# needs:` kind waits for, and whether this machine has it.
KINDS = {
    "cuda": lambda: torch.cuda.is_available(),
    "torchrun": lambda: False,  # several processes, one per GPU (tests/distributed runs the code)
    "msrun": lambda: False,  # MindSpore's launcher (tests/mindspore runs the code on CPU ranks)
}


@dataclass
class Block:
    page: str
    line: int
    code: str
    setup: str = ""
    output: str | None = None  # what it prints: the ``<!-- output -->`` block after it
    markers: dict = field(default_factory=dict)

    @property
    def where(self):
        return f"{self.page}:{self.line}"

    @property
    def needs(self):
        found = NEEDS.match(self.code)
        return found and (found["kind"], found["why"].strip())

    @property
    def continues(self):
        """Its first line says it uses what the page's previous block defined or saved."""
        return bool(CONTINUES.match(self.code))

    @property
    def kind(self):
        """How the test treats the block: recipe, needs, file, glue or printed."""
        if "recipe" in self.markers:
            return "recipe"
        if self.needs:
            return "needs"
        if "file" in self.markers:
            return "file"
        return "glue" if self.setup else "printed"


def comments_above(text, start):
    """The HTML comments written right above ``start`` (blank lines between them allowed)."""
    before = text[:start]
    while comment := COMMENT_ABOVE.search(before):
        key, _, value = comment["body"].strip().partition(":")
        yield key.strip(), value
        before = before[:comment.start()]


def blocks_of(text, page):
    """The page's ```python blocks, each with the HTML comments written right above it."""
    found = []
    for fence in FENCE.finditer(text):
        markers = dict(comments_above(text, fence.start()))
        if fence["lang"] != "python":
            if "output" in markers and found:
                found[-1].output = fence["code"]
            continue
        block = Block(page, text.count("\n", 0, fence.start()) + 1, fence["code"])
        for key, value in comments_above(text, fence.start()):
            if key == "setup":
                block.setup = textwrap.dedent(value.strip("\n")) + "\n" + block.setup
            elif key in ("recipe", "file", "raises"):
                block.markers[key] = value.strip()
        found.append(block)
    return found


ALL = [block for path in PAGES for block in blocks_of(path.read_text(), path.relative_to(ROOT).as_posix())]
RUN_PAGES = sorted({b.page for b in ALL if b.kind in ("printed", "glue", "file", "needs")})


def compiled(code, name):
    """``code`` compiled as the file ``<name>``, its lines in linecache: tracebacks show them, and
    ``inspect.getsource`` finds them (``@ms.jit`` reads its function's source)."""
    filename = f"<{name}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    return compile(code, filename, "exec")


def run_block(block, namespace):
    if block.setup:
        exec(compiled(block.setup, f"{block.where} setup"), namespace)
    code = compiled(block.code, block.where)
    expected = block.markers.get("raises")
    if not expected:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            exec(code, namespace)
        if block.output is not None:
            lines = [line.rstrip() for line in printed.getvalue().strip().splitlines()]
            assert lines == block.output.strip().splitlines(), f"{block.where} printed:\n{printed.getvalue()}"
        return
    with pytest.raises(Exception) as raised:
        exec(code, namespace)
    assert type(raised.value).__name__ == expected, f"{block.where}: {raised.value!r}"
    for printed in re.findall(rf"^# {expected}: (.*)$", block.code, re.M):
        assert str(raised.value).startswith(printed), \
            f"{block.where}: the page says '# {expected}: {printed}', the block raised {raised.value!r}"


@pytest.fixture
def page_folder(tmp_path, monkeypatch):
    """A working folder, importable, and what a page may leave behind cleaned up."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = set(sys.modules)
    torch.manual_seed(0)
    random.seed(0)
    yield tmp_path
    for name in set(sys.modules) - modules:
        if getattr(sys.modules[name], "__file__", "") and str(tmp_path) in sys.modules[name].__file__:
            del sys.modules[name]  # the page's own files (mylm.py), not the libraries it loaded
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def fresh_namespace(monkeypatch):
    """A new namespace: a module's, registered while it runs, so that a compiler that looks a
    function's globals up through its module (MindSpore's @ms.jit) finds them."""
    module = types.ModuleType("doc_page")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.__dict__


def run_page(blocks, folder, monkeypatch):
    """Run a page's blocks in order: each in a fresh namespace and working folder (which holds
    the page's files so far), unless it continues the block above. ``folder`` is importable."""
    namespace, files = None, {}
    for block in blocks:
        if block.kind == "recipe" or (block.kind == "needs" and not KINDS[block.needs[0]]()):
            continue
        if block.kind == "file":  # written, then imported: it runs as printed
            path = folder / block.markers["file"]
            path.write_text(block.code)
            files[path.name] = block.code
            if path.suffix == ".py":
                with contextlib.redirect_stdout(io.StringIO()):
                    importlib.import_module(path.stem)
            continue
        if namespace is None or not block.continues:
            namespace = fresh_namespace(monkeypatch)
            here = folder / f"block_{block.line}"
            here.mkdir()
            for name, text in files.items():
                (here / name).write_text(text)
            monkeypatch.chdir(here)
        run_block(block, namespace)


@pytest.mark.parametrize("page", RUN_PAGES)
def test_the_python_blocks_of_the_page_run(page, page_folder, monkeypatch):
    try:
        run_page([b for b in ALL if b.page == page], page_folder, monkeypatch)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in EXTRAS:
            raise
        pytest.skip(f"{page}: {e.name} is not installed (an extra: INSTALL.md)")


@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "needs"], ids=lambda b: b.where)
def test_a_block_that_needs_what_is_missing_here_is_listed(block):
    # pytest -ra lists each skip with its reason: no block is skipped in silence.
    kind, why = block.needs
    if not KINDS[kind]():
        pytest.skip(f"{block.where} not run: needs {kind} {why}")


def test_the_blocks_that_cannot_run_here():
    """Nothing is skipped in silence: every marked block, its kind known and its reason given."""
    marked = [b for b in ALL if b.kind == "needs"]
    for block in marked:
        kind, why = block.needs
        assert kind in KINDS and why, f"{block.where}: '# needs: {kind} {why}' (known: {sorted(KINDS)})"
    assert {(b.page, b.needs[0]) for b in marked} == {
        ("docs/DISTRIBUTED.md", "cuda"),
        ("docs/MINDSPORE.md", "msrun"),
        ("docs/PRECISION.md", "cuda"),
    }


def test_every_recipe_block_is_named_by_its_test():
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.name != Path(__file__).name)
    unnamed = []
    for block in (b for b in ALL if b.kind == "recipe"):
        name = re.escape(block.markers["recipe"])
        if not re.search(rf"""(["']){name}\1|recipe: {name}(?![\w-])""", tests):
            unnamed.append(f"{block.where}: {block.markers['recipe']}")
    assert not unnamed, unnamed


def test_the_pages_have_python_blocks_to_run():
    # The negative twin of the glob: the parser finds the blocks and their markers.
    kinds = {b.kind for b in ALL}
    assert {"printed", "glue", "file", "recipe", "needs"} <= kinds
    readme = [b for b in ALL if b.page == "README.md"]
    assert readme and all(compile(b.code, b.where, "exec") for b in readme)


SYNTHETIC = """
<!-- setup: x = 2 -->
```python
print(x * 21)
```

<!-- output -->
```
{printed}
```

<!-- raises: ZeroDivisionError -->
```python
# continues the block above
x / 0
# ZeroDivisionError: {message}
```
"""


@pytest.mark.parametrize("printed, message, error", [
    ("42", "division by zero", None),
    ("43", "division by zero", "printed"),
    ("42", "by zero!", "ZeroDivisionError"),
])
def test_a_page_whose_block_prints_or_raises_otherwise_fails(printed, message, error, page_folder,
                                                             monkeypatch):
    blocks = blocks_of(SYNTHETIC.format(printed=printed, message=message), "synthetic.md")
    assert [b.kind for b in blocks] == ["glue", "printed"] and blocks[0].output.strip() == printed
    if error is None:
        run_page(blocks, page_folder, monkeypatch)
    else:
        with pytest.raises(AssertionError, match=error):
            run_page(blocks, page_folder, monkeypatch)


def test_glue_counts_only_right_above_its_block(page_folder, monkeypatch):
    blocks = blocks_of("<!-- setup: x = 1 -->\n\nA paragraph between.\n\n```python\nprint(x)\n```\n", "p.md")
    assert blocks[0].kind == "printed"
    with pytest.raises(NameError):
        run_page(blocks, page_folder, monkeypatch)


UNDECLARED = """
```python
x = 2
open("saved.txt", "w").write("saved")
```

```python
{first_line}
{uses}
```
"""


@pytest.mark.parametrize("uses, error", [("print(x)", NameError),
                                         ("open('saved.txt').read()", FileNotFoundError)])
@pytest.mark.parametrize("declared", [False, True])
def test_a_block_uses_what_an_earlier_block_made_only_where_it_says_so(uses, error, declared, page_folder,
                                                                     monkeypatch):
    # Copied alone, a block that relies on an earlier one fails: the test runs it so, unless its
    # first line says that it continues the block above (a name defined there, a file saved).
    first_line = "# continues the block above" if declared else "# the second block"
    blocks = blocks_of(UNDECLARED.format(first_line=first_line, uses=uses), "p.md")
    assert [b.continues for b in blocks] == [False, declared]
    if declared:
        run_page(blocks, page_folder, monkeypatch)
    else:
        with pytest.raises(error):
            run_page(blocks, page_folder, monkeypatch)


def test_a_file_block_is_in_every_later_blocks_folder(page_folder, monkeypatch):
    page = ("<!-- file: notes.txt -->\n```python\nhello\n```\n\n"
            "```python\nassert open('notes.txt').read() == 'hello\\n'\n```\n")
    blocks = blocks_of(page, "p.md")
    assert [b.kind for b in blocks] == ["file", "printed"]
    run_page(blocks, page_folder, monkeypatch)
