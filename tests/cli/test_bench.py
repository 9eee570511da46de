"""`gradaccum bench --smoke`: the whole benchmark on tiny sizes writes its report and figures."""

import re

import pytest
import torch

from gradaccum.bench.loops import accelerate_available
from gradaccum.cli import main
from tests.doc_binding import REPO, Region, cited, mismatches, regions


def _row(text, first_cell):
    line = next(line for line in text.splitlines() if line.startswith(f"| {first_cell} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.slow
def test_smoke_run_writes_the_report_and_figures(tmp_path, capsys):
    threads = torch.get_num_threads()
    assert main(["bench", "--smoke", "--threads", "1", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads  # the run restores the caller's thread count
    assert "Wrote" in capsys.readouterr().out
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "Smoke run" in text and "gradaccum bench --out" in text and "--smoke" in text
    for png in ("bench_overhead.png", "bench_memory.png", "bench_exactness.png"):
        assert (tmp_path / png).stat().st_size > 5000
        assert f"]({png})" in text
    # Every table states the machine, torch, threads and malloc settings.
    assert text.count("; threads: ") >= 5 and text.count("; malloc: ") >= 5
    # Exactness: gradaccum matches the full batch to float64 rounding, the naive loop does not.
    header = _row(text, "case")
    for case in ("uneven", "tokens"):
        row = dict(zip(header, _row(text, case), strict=True))
        assert float(row["gradaccum"]) < 1e-12 < 1e-6 < float(row["naive"])
        if accelerate_available():
            assert float(row["accelerate"]) > 1e-6 and float(row["accelerate-recipe"]) < 1e-12
    # The seed's two buffers: measured within a few bytes of twice the parameters.
    seed_rows = [line for line in text.splitlines() if re.match(r"\| (mlp|cnn) \| 2 x 2 \| [\d,]+ \|", line)]
    assert len(seed_rows) == 2
    for line in seed_rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert int(cells[3].replace(",", "")) == 2 * int(cells[2].replace(",", ""))
        assert abs(int(cells[5].replace(",", ""))) < 64
    # Every number of the report is bound to its key of the results file written beside it.
    marked = regions(tmp_path / "BENCHMARKS.md")
    assert len(marked) == 7 and {r.results for r in marked} == {str(tmp_path / "results" / "bench.json")}
    for region in marked:
        as_docs = Region(REPO / "README.md", region.results, region.keys, region.text, region.line)
        assert mismatches(as_docs) == []
        assert cited(region.text)  # each part holds numbers
