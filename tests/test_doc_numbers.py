"""A measured number in README.md or docs/ is bound to one key of a results file a benchmark wrote.

How a page marks a part and binds its numbers: tests/doc_binding.py. Each number must read as its
own key's value, rounded as printed; a number moved to another cell reads as another key and fails.
Pages are found by glob, so a new page with measured numbers is checked as soon as it marks them;
every results file under docs/results/ must be cited by some page; and a measured-looking number
(``2.1e-2``) outside a marked part, program code and backticks fails (a quoted output counts), so
an unbound figure cannot hide.
"""

import json
import re

import pytest

from tests.doc_binding import (
    NUMBER,
    OPENER,
    REPO,
    Region,
    cited,
    expand,
    files_of,
    lookup,
    mismatches,
    pages,
    regions,
    written_as,
)

# Pages that cite measurements; each must mark them (a page may mark more than one results file).
MEASURED_PAGES = {
    "README.md", "SEED_EXPERIMENT.md", "MEMORY.md", "LANGUAGE_MODELS.md", "MINDSPORE.md",
    "BENCHMARKS.md", "LIGHTNING.md", "PRECISION.md", "DISTRIBUTED.md", "BATCHNORM.md", "GUIDE.md",
    "CHECK.md", "INTEGRATIONS.md", "TESTING.md", "MOE.md",
}
# A measured-looking number: a decimal mantissa with an exponent (2.1e-2, 9.1e-16). Round
# tolerances (1e-12) and settings have no decimal mantissa.
MEASURED = re.compile(r"(?<![\w.])\d\.\d+e[-+]?\d+")
# Code blocks: a program's source (python, bash, ...) holds settings; a plain block quotes an output.
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
OUTPUT_FENCES = {"", "text", "console", "output"}


def every_region() -> list[Region]:
    return [r for page in pages() for r in regions(page)]


def test_every_marked_number_reads_as_its_own_key():
    problems = [p for region in every_region() for p in mismatches(region)]
    assert problems == []


def test_every_marker_is_closed_and_names_its_file_from_the_root():
    for page in pages():
        text = page.read_text()
        found = regions(page)
        assert text.count(OPENER) == len(found), f"{page.name}: a results marker without <!-- /results -->"
        for region in found:
            assert (REPO / region.results).is_file(), f"{region.where()}: {region.results} does not exist"


def test_measured_pages_mark_their_numbers():
    marked = {r.page.name for r in every_region()}
    assert MEASURED_PAGES - marked == set()


def test_every_results_file_is_cited_by_a_page():
    cited_files = {name for r in every_region() for name in files_of(r)}
    files = {str(p.relative_to(REPO)) for p in (REPO / "docs" / "results").glob("*.json")}
    assert files - cited_files == set()


def test_no_measured_looking_number_outside_a_marked_part():
    loose = []
    for page in pages():
        text = page.read_text()
        for region in regions(page):
            text = text.replace(region.text, "")
        text = FENCE.sub(lambda m: m.group(2) if m.group(1) in OUTPUT_FENCES else "", text)
        text = re.sub(r"`[^`\n]*`", " ", text)
        text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
        loose += [f"{page.name}: {n}" for n in MEASURED.findall(text)]
    assert loose == []


def test_a_version_label_in_a_marked_part_is_its_results_files():
    for region in every_region():
        data = json.loads((REPO / region.results).read_text())
        versions = set(re.findall(r"gradaccum\W{1,4}(\d+\.\d+\.\d+)", region.text))
        recorded = set(re.findall(r'"gradaccum": "(\d+\.\d+\.\d+)"', json.dumps(data)))
        assert versions <= recorded, (region.where(), versions, recorded)


# The binding itself, and its negative twins.

@pytest.mark.parametrize(("token", "value", "matches"), [
    ("2.48e-3", 0.0024812, True), ("2.48e-3", 0.00249, False), ("1,339,412", 1339412, True),
    ("1,339,412", 1339413, False), ("181.0", 180.96, True), ("181.0", 181.2, False),
    ("1.97", 1.9685, True), ("5", 5, True), ("5", 6, False), ("1.5e7", 15_300_000, True),
    ("0.3187", 0.318657, True), ("0.3186", 0.318657, False), ("0.00e+00", 0.0, True),
    ("-3.9", -0.0389 * 100, True), ("+32", 32, True), ("+32", -32, False),
])
def test_a_number_matches_only_its_own_rounding(token, value, matches):
    # The negative twins: a drifted number is caught, not rounded into agreement.
    assert written_as(value, token) is matches


def test_keys_expand_in_reading_order_and_scale():
    assert expand("rows.{a,b}.{0..1}") == ["rows.a.0", "rows.a.1", "rows.b.0", "rows.b.1"]
    assert expand("x.{a.{0..1},b}") == ["x.a.0", "x.a.1", "x.b"]
    data = {"rows": [{"bytes": 3 * 2**20, "acc": 0.25}]}
    assert lookup(data, "rows.0.bytes/1048576") == 3.0
    assert lookup(data, "rows.0.acc*100") == 25.0
    for bad in ("rows.1.acc", "rows.0.missing", "rows.0", "rows"):
        with pytest.raises(KeyError):
            lookup(data, bad)
    report = {"measured": "32: 230.8 MiB vs 242.5 MiB (-4.8%), probes 8,16"}
    assert [lookup(report, f"measured#{i}") for i in range(4)] == [32, 230.8, 242.5, -4.8]
    with pytest.raises(KeyError):
        lookup(report, "measured#4")  # "8,16" is not a number of the page's either


def test_quoted_commands_settings_and_names_are_not_numbers():
    text = "run `--steps 4` on 2^24 with fp16, 8x8, gradaccum 0.2.0 and [a](x1.md) <!-- 5 -->\n"
    assert cited(text) == []
    quoted = "```\n$ gradaccum check --world-size 2\n1.weight  param  512x784  6.9e-18  yes\n```\n"
    assert [t for t, _ in cited(quoted)] == ["6.9e-18"]


def _region(tmp_path, text, keys, data):
    (tmp_path / "r.json").write_text(json.dumps(data))  # an absolute path: REPO / it is itself
    return Region(REPO / "README.md", str(tmp_path / "r.json"), tuple(keys), text, 1)


def test_a_number_moved_to_another_cell_fails(tmp_path):
    data = {"rows": {"window": {"ms": 245.8, "calls": 2}, "micro_batch": {"ms": 438.9, "calls": 16}}}
    keys = expand("rows.{window,micro_batch}.{ms,calls}")
    table = "| window | 245.8 | 2 |\n| micro_batch | 438.9 | 16 |\n"
    region = _region(tmp_path, table, keys, data)
    assert mismatches(region) == []
    swapped = "| window | 438.9 | 2 |\n| micro_batch | 245.8 | 16 |\n"
    assert len(mismatches(region, swapped)) == 2
    # Every number is still "somewhere in the file": only the binding catches the move.
    assert all(written_as(v, t) is False for v, t in [(245.8, "438.9"), (438.9, "245.8")])
    assert mismatches(region, table + "| extra | 1.0 |\n")  # a number without a key
    assert mismatches(region, table.replace("| 2 |", "|  |"))  # a key without its number
    data["rows"]["window"]["ms"] = 246.0  # the file re-measured, the page not updated
    assert mismatches(_region(tmp_path, table, keys, data))


def test_a_number_moved_within_a_real_page_fails():
    # The same on a marked table of the docs: swap two different numbers of one region.
    for region in every_region():
        tokens = [t for t, _ in cited(region.text)]
        pair = next(((a, b) for a in tokens for b in tokens
                     if tokens.count(a) == tokens.count(b) == 1 and a != b
                     and float(a.replace(",", "")) != float(b.replace(",", ""))), None)
        if pair is None:
            continue
        swap = {pair[0]: pair[1], pair[1]: pair[0]}
        swapped = NUMBER.sub(lambda m, swap=swap: swap.get(m.group(0), m.group(0)), region.text)
        if [t for t, _ in cited(swapped)] != tokens:
            assert mismatches(region, swapped), region.where()
            return
    pytest.fail("no marked part with two distinct numbers")


def test_a_quoted_output_is_what_its_code_prints_now(tmp_path):
    # The binding above checks the page against the results file; this checks the file against
    # the code: TESTING.md's worked example, rerun as benchmarks/doc_outputs.py ran it (the same
    # block, torch threads and CPU capability it recorded), must print the file's lines exactly.
    # A file written before the code changed its output fails here (the digits near rounding
    # included, which the recipe's own test, tests/torch/test_testing.py, cannot pin).
    import os
    import subprocess
    import sys

    recorded = json.loads((REPO / "docs" / "results" / "doc_outputs.json").read_text())
    capability = recorded["machine"]["cpu_capability"]
    run = recorded["outputs"]["testing_example"]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": str(run["torch_threads"]),
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"
    here = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    if here.stdout.strip() != capability:
        pytest.skip(f"this CPU cannot run torch's {capability} kernels (it runs {here.stdout.strip()})")
    text = (REPO / "docs" / "TESTING.md").read_text()
    block = re.findall(r"```python\n((?:(?!```).)*)```\n\nprints", text, re.S)[-1]
    (tmp_path / "testing_example.py").write_text(block)
    done = subprocess.run([sys.executable, "testing_example.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, check=True)
    assert done.stdout.splitlines() == [line["text"] for line in run["lines"]], done.stdout
