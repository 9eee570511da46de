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

What a reader sees is the block alone: the HTML comments do not render. So a block that uses a name
it neither defines nor imports (``model``, ``loader``, torchtitan's ``pp_group``) says so in its
visible first lines (``test_a_block_says_what_it_needs_that_it_does_not_define``): a comment that
names each one (``# given: model, opt and loader, your own``), or ``# continues the block above``
where the blocks above define them. Hidden glue may then supply them, for the test only.
"""

import ast
import builtins
import contextlib
import importlib
import io
import linecache
import random
import re
import symtable
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
        ("docs/MOE.md", "torchrun"),
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


BUILTINS = set(dir(builtins)) | {"__file__"}


class _InOrder(ast.NodeVisitor):
    """A block's module-level names in the order Python binds and reads them: a name read before
    anything binds it is missing. Function, lambda and class bodies run later, or in a scope of
    their own: ``undefined_names`` reads them with ``symtable``."""

    def __init__(self):
        self.bound, self.missing = set(), set()

    def read(self, name):
        if name not in self.bound:
            self.missing.add(name)

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            self.read(node.id)
        elif isinstance(node.ctx, ast.Store):
            self.bound.add(node.id)

    def visit_Assign(self, node):
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AugAssign(self, node):
        self.visit(node.value)
        if isinstance(node.target, ast.Name):
            self.read(node.target.id)
        self.visit(node.target)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.target)

    def visit_NamedExpr(self, node):
        self.visit(node.value)
        self.visit(node.target)

    def visit_For(self, node):
        self.visit(node.iter)
        self.visit(node.target)
        for statement in node.body + node.orelse:
            self.visit(statement)

    visit_AsyncFor = visit_For

    def visit_Import(self, node):
        self.bound.update((alias.asname or alias.name).partition(".")[0] for alias in node.names)

    def visit_ImportFrom(self, node):
        self.bound.update(alias.asname or alias.name for alias in node.names)

    def visit_ExceptHandler(self, node):
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.bound.add(node.name)
        for statement in node.body:
            self.visit(statement)

    def visit_FunctionDef(self, node):  # decorators, defaults, annotations now; the body when called
        arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg,
                     node.args.kwarg]
        annotations = [a.annotation for a in arguments if a is not None] + [node.returns]
        for expression in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults, *annotations]:
            if expression is not None:
                self.visit(expression)
        self.bound.add(node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        for expression in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.visit(expression)
        self.bound.add(node.name)

    def visit_Lambda(self, node):
        for expression in [*node.args.defaults, *node.args.kw_defaults]:
            if expression is not None:
                self.visit(expression)

    def _comprehension(self, node):  # its own scope, but the first iterable is read here
        self.visit(node.generators[0].iter)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension


def undefined_names(code):
    """The names ``code`` reads that it has not defined or imported by then, and that are not
    builtins: what a reader who copies the block alone must bring. At module level in the order
    the block runs (``model, opt = prepare(model, opt)`` needs ``model``); inside a function,
    class or comprehension, any name the block defines somewhere."""
    in_order = _InOrder()
    in_order.visit(ast.parse(code))
    top = symtable.symtable(code, "<block>", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    later = set()

    def walk(table):
        for symbol in table.get_symbols():
            if symbol.is_referenced() and symbol.is_global():
                later.add(symbol.get_name())
        for child in table.get_children():
            walk(child)

    for child in top.get_children():
        walk(child)
    return (in_order.missing | (later - defined)) - BUILTINS


def defined_names(code):
    """The names ``code`` defines or imports at module level."""
    return {s.get_name() for s in symtable.symtable(code, "<block>", "exec").get_symbols()
            if s.is_assigned() or s.is_imported()}


def leading_comment(code):
    """The block's visible first lines, while they are comments."""
    lines = []
    for line in code.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def unsaid_names(blocks):
    """For each block that uses names it does not define and does not say so: ``where: names``.

    A block says so in its leading comment: each name written there, or ``# continues the block
    above`` and the page's blocks above (back to one that does not continue) define or name it."""
    unsaid, known = [], set()
    for block in blocks:
        try:
            missing = undefined_names(block.code)
        except SyntaxError as error:
            unsaid.append(f"{block.where}: not Python ({error.msg}, line {error.lineno})")
            continue
        said = leading_comment(block.code)
        if not block.continues:
            known = set()
        missing -= known
        missing = {name for name in missing if not re.search(rf"(?<!\w){re.escape(name)}(?!\w)", said)}
        if missing:
            unsaid.append(f"{block.where}: {', '.join(sorted(missing))}")
        known |= defined_names(block.code) | undefined_names(block.code)
    return unsaid


@pytest.mark.parametrize("page", sorted({b.page for b in ALL}))
def test_a_block_says_what_it_needs_that_it_does_not_define(page):
    # Every ```python block, recipes and files too: copied alone from the rendered page, it runs,
    # or its first lines say what the reader must bring.
    unsaid = unsaid_names([b for b in ALL if b.page == page])
    assert not unsaid, f"name each in the block's first lines, or say '# continues the block above': {unsaid}"


NEEDY = """
```python
{first}
import torch

def train():
    for x, y in loader:
        model(x).sum().backward()
    return [opt.step() for _ in range(1)]
```

```python
{second}
train()
```
"""


@pytest.mark.parametrize("first, second, unsaid", [
    ("", "", ["p.md:2: loader, model, opt", "p.md:12: train"]),
    ("# given: model, opt and loader, your own", "", ["p.md:12: train"]),
    ("# given: model and loader", "# continues the block above", ["p.md:2: opt"]),
    ("# given: model, opt, loader", "# continues the block above", []),
    ("# given: the model, opt, loader", "# continues the block above, which defines train", []),
    ("import builtins  # given: model, opt, loader", "", ["p.md:2: loader, model, opt", "p.md:12: train"]),
])
def test_a_block_that_needs_a_name_it_does_not_say_is_found(first, second, unsaid):
    blocks = blocks_of(NEEDY.format(first=first, second=second), "p.md")
    assert unsaid_names(blocks) == unsaid


def test_a_block_that_is_not_python_is_found():
    assert unsaid_names(blocks_of("```python\n>>> print(1)\n```\n", "p.md")) == [
        "p.md:1: not Python (invalid syntax, line 1)"]


def test_what_a_block_needs_reads_functions_classes_and_comprehensions():
    code = textwrap.dedent("""
        import torch as t
        class Net(t.nn.Module):
            width = size * 2
            def forward(self, x):
                return [layer(x) for layer in self.layers] + [scale]
        for i in range(3):
            total = i
        print(total, Net, len, [n for n in names])
        model, opt = prepare(model, t.optim.SGD([], lr=0.1))
        count += 1
        def step(batch: Batch = default) -> None:
            return opt, batch
        """)
    assert undefined_names(code) == {"size", "scale", "names", "prepare", "model", "count", "Batch",
                                     "default"}
