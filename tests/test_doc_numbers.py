"""A measured number in README.md or docs/ comes from a results file a benchmark wrote.

A page marks the measured part it cites, a table or a paragraph, between
``<!-- results: docs/results/NAME.json -->`` and ``<!-- /results -->``. Every number written there
(outside backticks, which hold commands and settings) must be a number of that file, rounded as
the page writes it: ``2.48e-3`` matches 0.0024812, ``1,339,412`` only 1339412. A page that cites a
number its file does not hold fails here, and so does a marker whose file is missing. Measured
pages carry no old version label: a ``gradaccum`` version in a marked part is its file's.
"""

import json
import math
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
REGION = re.compile(r"<!-- results: (\S+) -->\n(.*?)<!-- /results -->", re.S)
# A number: digits with optional thousands commas, decimals and exponent; not part of a word,
# a version (0.2.0), a power (2^24) or a name (fp16, x86_64).
NUMBER = re.compile(r"(?<![\w.^])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?!(?!x\b)[\w^]|\.\d)")


def regions():
    for page in PAGES:
        for match in REGION.finditer(page.read_text()):
            yield page, match.group(1), match.group(2)


def numbers_of(value):
    """Every number in a results file: its numeric leaves, and the numbers inside its strings."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield float(value)
    elif isinstance(value, str):
        for token in NUMBER.findall(value):
            yield from _parse(token)
    elif isinstance(value, dict):
        for v in value.values():
            yield from numbers_of(v)
    elif isinstance(value, list):
        for v in value:
            yield from numbers_of(v)


def _parse(token):
    try:
        yield float(token.replace(",", ""))
    except ValueError:
        return


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
    decimals = len(token.split("e")[0].split(".")[1]) if "." in token.split("e")[0] else 0
    if "e" not in token.lower():
        return round(value, decimals) == page
    digits = significant(token)
    return float(f"{value:.{digits - 1}e}") == page


def cited(text: str) -> list[str]:
    text = re.sub(r"`[^`]*`", " ", text)  # commands and settings
    return NUMBER.findall(text)


def test_every_number_in_a_marked_part_is_in_its_results_file():
    missing = []
    for page, results, text in regions():
        path = REPO / results
        assert path.is_file(), f"{page.name} cites {results}, which does not exist"
        held = list(numbers_of(json.loads(path.read_text())))
        for token in cited(text):
            if not any(written_as(v, token) for v in held):
                missing.append(f"{page.name}: {token} (not in {results})")
    assert missing == []


def test_measured_pages_mark_their_results():
    marked = {page.name for page, _, _ in regions()}
    assert {"BENCHMARKS.md", "PRECISION.md", "DISTRIBUTED.md", "BATCHNORM.md"} <= marked


def test_a_version_label_in_a_marked_part_is_its_results_files():
    for page, results, text in regions():
        data = json.loads((REPO / results).read_text())
        versions = {v for v in re.findall(r"gradaccum\W{1,4}(\d+\.\d+\.\d+)", text)}
        recorded = set(re.findall(r'"gradaccum": "(\d+\.\d+\.\d+)"', json.dumps(data)))
        assert versions <= recorded, (page.name, versions, recorded)


@pytest.mark.parametrize(("token", "value", "matches"), [
    ("2.48e-3", 0.0024812, True), ("2.48e-3", 0.00249, False), ("1,339,412", 1339412, True),
    ("1,339,412", 1339413, False), ("181.0", 180.96, True), ("181.0", 181.2, False),
    ("1.97", 1.9685, True), ("5", 5, True), ("5", 6, False), ("1.5e7", 15_300_000, True),
])
def test_a_number_matches_only_its_own_rounding(token, value, matches):
    # The negative twins: a drifted number is caught, not rounded into agreement.
    assert written_as(value, token) is matches


def test_a_page_citing_a_number_its_file_lacks_fails(tmp_path):
    text = "| window | 181.0 | 2 |\n"
    held = [181.04, 2.0]
    assert all(any(written_as(v, t) for v in held) for t in cited(text))
    assert not all(any(written_as(v, t) for v in held) for t in cited(text.replace("181.0", "182.0")))
    assert cited("run `--steps 4` on 2^24 with fp16 and gradaccum 0.2.0") == []
