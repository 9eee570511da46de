"""benchmarks/README.md's index against the folder: every results file and figure is listed once,
with a command whose script exists and writes it, and with exactly the pages that bind it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.doc_binding import REPO, files_of, pages, regions

INDEX = REPO / "benchmarks" / "README.md"
ROW = re.compile(r"^\| `(?P<file>[^`]+)` \| (?P<command>.+?) \| (?P<pages>[^|]+) \|$", re.M)
COMMAND = re.compile(r"`([^`]+)`")


def indexed(text: str) -> dict[str, tuple[str, list[str]]]:
    """file -> (the command cell, the pages), from the index's table.

    Raises:
        AssertionError: a file listed twice.
    """
    rows: dict[str, tuple[str, list[str]]] = {}
    for m in ROW.finditer(text):
        assert m["file"] not in rows, f"{m['file']} is listed twice"
        rows[m["file"]] = (m["command"], [p.strip() for p in m["pages"].split(",")])
    return rows


def measured_files(repo: Path) -> set[str]:
    """Every results file and figure of the pages: docs/results/*.json, docs/*.json, docs/*.png."""
    return {str(p.relative_to(repo)) for pattern in ("docs/results/*.json", "docs/*.json", "docs/*.png")
            for p in repo.glob(pattern)}


def binding_pages() -> dict[str, set[str]]:
    """file -> the pages that bind it: a results file through a marked part, a figure as an image."""
    found: dict[str, set[str]] = {}
    for page in pages():
        name = str(page.relative_to(REPO))
        for region in regions(page):
            for f in files_of(region):
                found.setdefault(f, set()).add(name)
        for image in re.findall(r"!\[[^]]*\]\(([^)\s]+\.png)\)", page.read_text()):
            found.setdefault(str((page.parent / image).resolve().relative_to(REPO)), set()).add(name)
    return found


def writes(command: str, target: str) -> bool:
    """True when ``command`` (one cell) runs a script of this repository that writes ``target``:
    it names the file in its arguments, or the script's source names it (its default), or the
    cell says where the file is copied from."""
    for code in COMMAND.findall(command):
        words = shlex.split(code)
        script = next((w for w in words if w.endswith((".py", ".sh"))), None)
        if script is not None:
            assert (REPO / script).is_file(), f"{script} (for {target}) does not exist"
            if target in words or Path(target).name in (REPO / script).read_text():
                return True
        elif words[:1] == ["gradaccum"]:
            where = "bench/run.py" if words[1] == "bench" else f"cli/{words[1]}.py"
            module = REPO / "src" / "gradaccum" / where
            assert module.is_file(), f"`{code}` names no command of gradaccum"
            if Path(target).name in module.read_text():
                return True
    return "copied here" in command


def test_every_results_file_and_figure_is_indexed_once():
    rows = indexed(INDEX.read_text())
    assert set(rows) == measured_files(REPO)


@pytest.mark.parametrize("target", sorted(measured_files(REPO)))
def test_each_file_has_a_command_that_writes_it_and_the_pages_that_bind_it(target):
    rows = indexed(INDEX.read_text())
    command, listed = rows[target]
    assert writes(command, target), f"{target}: {command!r} does not write it"
    assert set(listed) == binding_pages().get(target, set()), target


def test_a_file_missing_from_the_index_or_listed_twice_fails(tmp_path):
    rows = INDEX.read_text()
    (tmp_path / "docs" / "results").mkdir(parents=True)
    for name in (*indexed(rows), "docs/results/new_benchmark.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    assert set(indexed(rows)) != measured_files(tmp_path)
    first = next(m.group(0) for m in ROW.finditer(rows))
    with pytest.raises(AssertionError, match="listed twice"):
        indexed(rows + "\n" + first + "\n")


def test_a_command_that_does_not_write_its_file_fails():
    assert writes("`python benchmarks/ddp_sync.py --json docs/results/ddp_sync.json`",
                  "docs/results/ddp_sync.json")
    assert not writes("`python benchmarks/ddp_sync.py --json docs/results/ddp_sync.json`",
                      "docs/results/fsdp_memory.json")
    with pytest.raises(AssertionError, match="does not exist"):
        writes("`python benchmarks/no_such_script.py`", "docs/results/x.json")
