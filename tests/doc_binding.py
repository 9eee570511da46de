"""How a page binds each measured number to one key of a results file (tests/test_doc_numbers.py).

A page wraps a measured part, a table, a paragraph or a quoted output, in::

    <!-- results: docs/results/NAME.json
    rows.{64x1,32x2}.{seconds,peak_rss_mib} speedup.ratio
    -->
    ...the part...
    <!-- /results -->

The opening comment names the results file and then, in reading order, the key of every number in
the part (left to right, top to bottom). A key is a path of dict keys and list indices joined by
``.``; ``{a,b}`` and ``{0..2}`` expand as in a shell (``x.{a,b}.y`` is ``x.a.y x.b.y``); a trailing
``*100`` or ``/1048576`` scales the value to the page's unit; quotes hold a key with spaces
(``'rows.0.bf16 .grad'``), and a key may hold dots; ``key#2`` is the third number of the string at
``key`` (a report's quoted line). A key of another results file names it first:
``docs/results/OTHER.json:rows.0.ms`` (a table citing several benchmarks is one marked part: a
comment inside a Markdown table would end it). Number *i* of the part must read as
key *i*'s value rounded as the page prints it (``2.48e-3`` is 0.0024812, ``1,339,412`` only
1339412), and the part must hold as many numbers as the marker names keys: a number moved to
another cell, added or dropped fails. Not counted: text in backticks (commands and settings),
HTML comments, link targets, a table's header row (labels), a list item's number, a number naming an
epoch or a seed (``epoch 3``, ``seed 0``), fence lines and ``$ `` command lines of a quoted output.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OPENER = "<!-- results:"
REGION = re.compile(r"<!-- results: (\S+)(.*?)-->\n(.*?)<!-- /results -->", re.S)
# A number: digits with optional thousands commas, decimals and exponent; not part of a word, a
# version (0.2.0), a power (2^24) or a name (fp16, x86_64, 8x8, 1.weight, GPT-2).
NUMBER = re.compile(r"(?<![\w.^,])(?<![A-Za-z]-)[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?"
                    r"(?!(?!x\b)[\w^]|\.\d|\.[A-Za-z_]|,\d)")
# A number that names an epoch or a seed ("epoch 3", "seed 0") is a label, not a measurement.
LABEL = re.compile(r"(?i)\b(epochs?|seeds?) \d+\b")
SCALE = re.compile(r"^(.*?)([*/])([0-9.e+-]+)$")


@dataclass(frozen=True)
class Region:
    """One marked part of a page: its results file, its keys in reading order and its text."""

    page: Path
    results: str
    keys: tuple[str, ...]
    text: str
    line: int

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def pages() -> list[Path]:
    """Every page a reader sees: the README and docs/*.md, found by glob (new pages included)."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def regions(page: Path, text: str | None = None) -> list[Region]:
    text = page.read_text() if text is None else text
    found = []
    for match in REGION.finditer(text):
        keys = tuple(k for expr in shlex.split(match.group(2)) for k in expand(expr))
        line = text.count("\n", 0, match.start()) + 1
        found.append(Region(page, match.group(1), keys, match.group(3), line))
    return found


def files_of(region: Region) -> set[str]:
    """The results files a marked part reads: its marker's, and those its keys name."""
    return {region.results} | {k.split(".json:", 1)[0] + ".json" for k in region.keys if ".json:" in k}


def expand(expr: str) -> list[str]:
    """Shell-style brace expansion: ``a.{x,y}.{0..1}`` -> a.x.0 a.x.1 a.y.0 a.y.1.

    Example:
        >>> expand("r.{a,b}.{0..1}")
        ['r.a.0', 'r.a.1', 'r.b.0', 'r.b.1']
    """
    start = expr.find("{")
    if start < 0:
        return [expr]
    depth, end, cuts = 0, -1, []
    for i in range(start, len(expr)):
        depth += {"{": 1, "}": -1}.get(expr[i], 0)
        if expr[i] == "," and depth == 1:
            cuts.append(i)
        if depth == 0:
            end = i
            break
    if end < 0:
        raise ValueError(f"unbalanced braces in key {expr!r}")
    bounds = [start, *cuts, end]
    options = [expr[a + 1:b] for a, b in itertools.pairwise(bounds)]
    span = re.fullmatch(r"(-?\d+)\.\.(-?\d+)", options[0]) if len(options) == 1 else None
    if span:
        options = [str(i) for i in range(int(span.group(1)), int(span.group(2)) + 1)]
    head, tail = expr[:start], expr[end + 1:]
    return [key for option in options for key in expand(head + option + tail)]


def lookup(data: Any, key: str) -> float:
    """The value a key names, scaled by its ``*F`` or ``/F`` suffix.

    Raises:
        KeyError: the path does not exist, or does not end at a number.
    """
    scaled = SCALE.match(key)
    path, op, factor = (scaled.group(1), scaled.group(2), float(scaled.group(3))) if scaled else (
        key, "*", 1.0)
    path, _, nth = path.partition("#")
    node, parts = data, path.split(".")
    while parts:
        node, parts = _step(node, parts, key)
    if nth:  # the nth number a string holds, read as a page reads it
        tokens = [t for t, _ in cited(node)] if isinstance(node, str) else []
        if not nth.isdigit() or int(nth) >= len(tokens):
            raise KeyError(f"{key}: {node!r} holds no number #{nth}")
        node = float(tokens[int(nth)].replace(",", ""))
    if isinstance(node, str) and re.fullmatch(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?", node):
        node = float(node)  # the machine's "2" CPUs
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise KeyError(f"{key}: {node!r} is not a number")
    return node * factor if op == "*" else node / factor


def _step(node: Any, parts: list[str], key: str) -> tuple[Any, list[str]]:
    """One step down: a list index, or the longest dict key made of the next parts (a key may
    hold dots: ``rows.0.bf16 .grad``)."""
    index = int(parts[0]) if re.fullmatch(r"-?\d+", parts[0]) else None
    if isinstance(node, list) and index is not None and -len(node) <= index < len(node):
        return node[index], parts[1:]
    if isinstance(node, dict):
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in node:
                return node[".".join(parts[:n])], parts[n:]
    raise KeyError(f"{key}: no {parts[0]!r} here")


def cited(text: str) -> list[tuple[str, int]]:
    """The numbers of a marked part in reading order, each with its line within the part."""
    found = []
    fenced = False
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced and line.lstrip().startswith("$ "):
            continue
        if not fenced and i + 1 < len(lines) and re.match(r"\|\s*:?-{3}", lines[i + 1]):
            continue  # a table's header row: labels, not measurements
        line = re.sub(r"<!--.*?-->", " ", line)
        line = re.sub(r"\]\([^)]*\)", "]", line)  # link targets
        line = LABEL.sub(lambda m: m.group(1), line)
        if not fenced:
            line = re.sub(r"`[^`]*`", " ", line)  # commands and settings
            line = re.sub(r"^\s*\d+\.\s", " ", line)  # an ordered list's item number
        found += [(token, i) for token in NUMBER.findall(line)]
    return found


def _data(files: dict[str, Any], key: str) -> Any:
    """The results file a key reads: its own ``docs/results/OTHER.json:`` prefix, else the
    marker's (the first file loaded)."""
    if ".json:" not in key:
        return next(iter(files.values()))
    name = key.split(".json:", 1)[0] + ".json"
    if name not in files:
        files[name] = json.loads((REPO / name).read_text())
    return files[name]


def significant(token: str) -> int:
    mantissa = token.lstrip("+-").split("e")[0].replace(",", "")
    digits = mantissa.replace(".", "").lstrip("0")
    if "." not in mantissa:
        digits = digits.rstrip("0") or "0"  # 16,000 is written to 2 digits, and 0 to 1
    return max(len(digits), 1)


def written_as(value: float, token: str) -> bool:
    """Does ``value``, rounded to the token's digits, read as the token?"""
    page = float(token.replace(",", ""))
    if value == page:
        return True
    if not math.isfinite(value) or value == 0:
        return False
    mantissa = token.split("e")[0]
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    if "e" not in token.lower():
        return round(value, decimals) == page
    return float(f"{value:.{significant(token) - 1}e}") == page


def mismatches(region: Region, text: str | None = None) -> list[str]:
    """What in a marked part does not read as its keys (empty when the part agrees).

    ``text`` replaces the part's text (the negative tests move a number with it).
    """
    path = REPO / region.results
    if not path.is_file():
        return [f"{region.where()}: {region.results} does not exist"]
    if not region.keys:
        return [f"{region.where()}: the marker names no keys"]
    files = {region.results: json.loads(path.read_text())}
    tokens = cited(region.text if text is None else text)
    problems = []
    if len(tokens) != len(region.keys):
        problems.append(f"{region.where()}: {len(tokens)} numbers, {len(region.keys)} keys")
    for (token, line), key in zip(tokens, region.keys, strict=False):
        try:
            value = lookup(_data(files, key), key.split(".json:", 1)[-1])
        except (KeyError, OSError) as err:
            problems.append(f"{region.where()}+{line}: {token}: {err}")
            continue
        if not written_as(value, token):
            problems.append(f"{region.where()}+{line}: {token} is not {key} = {value!r}")
    return problems
