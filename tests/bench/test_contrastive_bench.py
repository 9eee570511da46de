"""benchmarks/contrastive.py in miniature: backward_cached and sentence-transformers' cached loss
are the full batch, naive accumulation is not, and backward_cached holds one chunk's activations."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "contrastive.py"
RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "contrastive.json"


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("sentence_transformers")
    spec = importlib.util.spec_from_file_location("contrastive_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.slow  # two models, four methods, float64 copies: about 20 s on 2 cores
def test_cached_methods_are_the_full_batch_at_one_chunks_activations(bench, tmp_path, capsys):
    out = tmp_path / "contrastive.json"
    results = bench.main(["--chunks", "1", "4", "--clip-pairs", "8", "--mnrl-pairs", "8", "--repeats", "1",
                          "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(results["rows"]))
    rows = {(r["model"], r["chunks"], r["method"]): r for r in results["rows"]}
    assert len(rows) == 2 * 3 + 2 * 4
    for model in ("clip", "mnrl"):
        cached, naive = rows[(model, 4, "backward_cached")], rows[(model, 4, "naive")]
        assert cached["max_abs_grad_diff"] < 1e-12 < 1e-6 < naive["max_abs_grad_diff"]
        assert rows[(model, 4, "full batch")]["max_abs_grad_diff"] == 0.0
        # One chunk's activations, not the batch's: at most naive accumulation's (the same
        # chunks, or half of them on mnrl) plus the loss's graph, well below the full batch's.
        full = rows[(model, 4, "full batch")]["saved_activations_bytes"]
        assert cached["saved_activations_bytes"] < full / 2
    st = rows[("mnrl", 4, "sentence-transformers cached")]
    assert st["max_abs_grad_diff"] < 1e-12
    assert st["saved_activations_bytes"] == pytest.approx(rows[("mnrl", 4, "backward_cached")]
                                                          ["saved_activations_bytes"], rel=0.05)
    assert [g["chunks"] for g in results["goals"]] == [4, 4]
    assert "| clip | 4 | backward_cached |" in capsys.readouterr().out


def test_the_results_file_has_one_record_per_model_chunks_and_method():
    data = json.loads(RESULTS.read_text())
    keys = [(r["model"], r["chunks"], r["method"]) for r in data["rows"]]
    assert len(keys) == len(set(keys)) == 3 * 3 + 3 * 4
    assert {r["chunks"] for r in data["rows"]} == {1, 4, 16}
    assert all(r["max_abs_grad_diff"] < 1e-12 for r in data["rows"] if "cached" in r["method"])
    assert data["machine"]["torch"] and data["command"].startswith("python benchmarks/contrastive.py")
