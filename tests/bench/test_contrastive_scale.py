"""benchmarks/contrastive_scale.py: its measures in miniature (in this process), its goals read
from what it measured, and its results file holds every point the page binds."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from gradaccum.bench.contrastive_scale import ScaleSizes

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "contrastive_scale.py"
RESULTS = ROOT / "docs" / "results" / "contrastive_scale.json"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("contrastive_scale_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.SIZES = ScaleSizes(inputs=6, width=8, dim=4, chunk=64)
    yield module
    del sys.modules[spec.name]


def test_the_tiled_loss_through_backward_cached_is_the_full_batch_chunked_or_not(bench):
    out = bench.exact(200)  # chunks of 64: four chunks, the last short
    assert out["chunked_max_abs_diff"] < 1e-12 and out["unchunked_max_abs_diff"] < 1e-12
    assert out["largest_grad"] > 1e-2


def test_a_point_measures_one_step(bench):
    for method in ("dense", "tiled"):
        out = bench.point(method, 256)
        assert out["method"] == method and out["pairs"] == 256
        assert out["seconds"] > 0 and out["peak_growth_bytes"] >= 0


def test_goals_are_read_from_the_measured_figures(bench):
    gib = 2**30
    points = [{"method": "tiled", "pairs": 16384, "peak_growth_bytes": 0.1 * gib},
              {"method": "tiled", "pairs": 262144, "peak_growth_bytes": 2.5 * gib}]
    ratios = [{"pairs": 8192, "tiled_vs_dense": 1.2}, {"pairs": 16384, "tiled_vs_dense": 1.4}]
    exacts = [{"chunked_max_abs_diff": 1e-15, "unchunked_max_abs_diff": 2e-15}]
    ranks = [{"method": "exact", "ranks": [{"max_abs_diff": 3e-12}]}]
    met = {g["goal"]: (g["value"], g["met"]) for g in bench.goals(points, ratios, exacts, ranks)}
    assert met == {
        "tiled at 262,144 pairs: completes, peak growth <= 2 GiB": (2.5, False),
        "peak growth from 16,384 to 262,144 pairs rises at most 20x": (25.0, False),
        "tiled time <= 1.3x dense at 8,192 pairs": (1.2, True),
        "tiled time <= 1.3x dense at 16,384 pairs": (1.4, False),
        "float64 within 1e-12 of the dense full batch (1, 2, 4 ranks)": (3e-12, False),
    }


def test_the_results_file_holds_every_point_of_the_page():
    data = json.loads(RESULTS.read_text())
    tiled = {p["pairs"]: p for p in data["points"] if p["method"] == "tiled"}
    dense = {p["pairs"]: p for p in data["points"] if p["method"] == "dense"}
    assert sorted(tiled) == sorted(dense) == [2**k for k in range(12, 19)]
    assert all("peak_growth_bytes" in p for p in tiled.values())  # every tiled point ran
    assert {b for b, p in dense.items() if "skipped" in p} == {b for b in dense if b >= 32768}
    diffs = [e[k] for e in data["exact"] for k in ("chunked_max_abs_diff", "unchunked_max_abs_diff")]
    assert diffs and max(diffs) < 1e-12
    exact_worlds = sorted(r["world"] for r in data["ranks"] if r["method"] == "exact")
    assert exact_worlds == [1, 2, 4]
    assert data["command"].startswith("python benchmarks/contrastive_scale.py")
