"""benchmarks/lm_token_weighting.py in miniature: naive loss / N drifts, gradaccum does not."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_token_weighting.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("lm_token_weighting", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_gradaccum_tracks_the_full_batch_and_the_naive_loop_does_not(bench, capsys, tmp_path):
    arms = bench.main(["--steps", "3", "--micro", "2", "--accum", "3", "--layers", "1", "--width", "16",
                       "--seq", "16", "--threads", "1", "--plot", str(tmp_path / "lm.png")])
    by_name = {arm.name: arm for arm in arms}
    assert list(by_name) == list(bench.ARMS)
    assert by_name["full batch"].diffs == [0.0, 0.0, 0.0]
    assert max(by_name["gradaccum"].diffs) < 1e-12
    assert min(by_name["naive loss / N"].diffs) > 1e-6
    assert min(by_name["n_items without shift"].diffs) > 1e-6
    out = capsys.readouterr().out
    assert "torch_threads: 1" in out and "| gradaccum |" in out and "after 3 steps" in out
    assert (tmp_path / "lm.png").stat().st_size > 0


def test_batches_are_padded_pieces_of_the_standard_library(bench):
    text, files = bench.corpus(10_000)
    assert len(text) >= 10_000 and files >= 1
    ids, labels = next(bench.batches(text, 4, 16, seed=0))
    assert ids.shape == labels.shape == (4, 16)
    real = labels != -100
    assert (real.sum(1) >= 8).all() and (ids[~real] == 0).all() and (labels[real] == ids[real]).all()
    assert bytes(ids[0][real[0]].tolist()) in text
