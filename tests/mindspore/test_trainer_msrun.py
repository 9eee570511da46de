"""`gradaccum train --backend mindspore` under msrun on 2 CPU ranks: rank 0 prints and writes,
and the run equals one process on the same global micro-batches (float32 rounding only)."""


import pytest

pytest.importorskip("mindspore.nn", reason="needs MindSpore: pip install 'gradaccum[mindspore]'")

import numpy as np
import torch

from gradaccum.cli import main
from gradaccum.demos.metrics import read_metrics
from tests.ranks import run_msrun

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'

# 200 items: each rank's 100 split into micro-batches of 16 leave 4, so the run weights by items
# and flushes a short window at each epoch's end (one process: 200 in micro-batches of 32).
SMALL = ["--limit-train", "200", "--limit-test", "100", "--epochs", "2", "--no-progress", "--log-every", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("msrun-train")
    run_msrun(["python", "-m", "gradaccum", "train", "--backend", "mindspore", "--micro-batch", "16",
               "--steps", "2", *SMALL, "--out", str(out / "ranks")], out)
    assert main(["train", "--backend", "mindspore", "--micro-batch", "32", "--steps", "2", *SMALL,
                 "--out", str(out / "one")]) == 0
    return out


def test_two_ranks_train_like_one_process_on_the_global_batch(runs):
    with np.load(runs / "ranks" / "params.npz") as a, np.load(runs / "one" / "params.npz") as b:
        for k in a.files:
            torch.testing.assert_close(torch.from_numpy(a[k]), torch.from_numpy(b[k]))
    ranks, one = (read_metrics(runs / name / "metrics.jsonl") for name in ("ranks", "one"))
    for kind in ("window", "epoch"):
        got = [r for r in ranks if r["kind"] == kind]
        want = [r for r in one if r["kind"] == kind]
        assert len(got) == len(want) > 0
    windows = [(r["samples"], r["loss"]) for r in ranks if r["kind"] == "window"]
    expected = [(r["samples"], r["loss"]) for r in one if r["kind"] == "window"]
    assert [s for s, _ in windows] == [s for s, _ in expected]  # samples count every rank's items
    assert [v for _, v in windows] == pytest.approx([v for _, v in expected], rel=1e-5)
    accuracies = [[r["test_accuracy"] for r in m if r["kind"] == "epoch"] for m in (ranks, one)]
    assert accuracies[0] == accuracies[1]


def test_only_rank_0_prints(runs):
    rank0 = (runs / "logs" / "worker_0.log").read_text()
    rank1 = (runs / "logs" / "worker_1.log").read_text()
    assert "x 2 ranks = batch 64" in rank0
    assert rank0.count("Test: Accuracy: ") == 2 and "loss: " in rank0
    assert "Test: Accuracy" not in rank1 and "loss: " not in rank1 and "gradaccum train" not in rank1
