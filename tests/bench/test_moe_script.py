"""benchmarks/moe.py in miniature: every part runs and writes what docs/MOE.md binds, and a part
rerun keeps the others in the results file."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # about 20 s of tiny training: deselected by -m 'not slow'

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("moe_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_parts_run_in_miniature_and_a_rerun_keeps_the_others(bench, tmp_path, capsys):
    out = tmp_path / "moe.json"
    small = ["--rounds", "2", "--warmup", "1", "--steps", "2", "--batch", "2", "--seq", "8", "--hidden", "16",
             "--train-windows", "3", "--tail", "2", "--json", str(out)]
    bench.main(["--parts", "cost,memory,training", *small])
    first = json.loads(out.read_text())
    assert set(first["cost"]) == {"hand loop", "two passes by hand", *bench.MODES}
    assert first["cost"]["hand loop"]["vs_hand_loop"] == 1.0
    assert {"vs_hand_loop", "vs_rolling"} <= set(first["memory"]["global"])
    for mode in ("global", "micro_batch"):
        curve = first["training"][mode]["curve"]
        assert len(curve) == 3 and all(min(c["balance"]) >= 1.0 for c in curve)
    bench.main(["--parts", "cost", *small])
    second = json.loads(out.read_text())
    assert second["training"] == first["training"] and second["memory"] == first["memory"]
    assert "| global |" in capsys.readouterr().out
