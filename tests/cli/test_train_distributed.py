"""`torchrun --nproc-per-node 2 -m gradaccum train`: the same run as one process with the same
global batch (DistributedSampler shares, DDP, one sync per window), printed and written once."""

import numpy as np
import pytest

from gradaccum.cli import main
from gradaccum.demos.metrics import read_metrics
from gradaccum.run_folder.run_lock import LOCK
from tests.ranks import torchrun

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'

# 600 items: neither process count divides them into whole micro-batches, so the last
# micro-batch of each epoch is weighted by its items (over both ranks) and flushed.
COMMON = ["--limit-train", "600", "--limit-test", "200", "--epochs", "2", "--no-progress",
          "--optimizer", "momentum", "--log-every", "5"]


def train(args, tmp_path):
    return torchrun(["-m", "gradaccum", "train", *args], tmp_path)


def windows(out):
    return [(r["samples"], r["loss"]) for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "window"]


def test_two_ranks_train_exactly_like_one_process_with_the_same_global_batch(tmp_path, capsys):
    text = train([*COMMON, "--global-batch", "64", "--micro-batch", "16", "--out", str(tmp_path / "two")],
                 tmp_path)
    assert text.count("gradaccum train: ") == 1  # rank 0 prints for both
    assert "micro-batch 16 x steps 2 x 2 ranks = batch 64" in text
    one_args = ["train", *COMMON, "--micro-batch", "32", "--steps", "2", "--out", str(tmp_path / "one")]
    assert main(one_args) == 0
    one = capsys.readouterr().out
    accuracy = [line for line in text.splitlines() if line.startswith("Test: Accuracy")]
    assert accuracy == [line for line in one.splitlines() if line.startswith("Test: Accuracy")]
    (two_w, one_w) = windows(tmp_path / "two"), windows(tmp_path / "one")
    assert [s for s, _ in two_w] == [s for s, _ in one_w]
    np.testing.assert_allclose([v for _, v in two_w], [v for _, v in one_w], rtol=1e-5)
    with np.load(tmp_path / "one" / "params.npz") as a, np.load(tmp_path / "two" / "params.npz") as b:
        for k in a.files:
            np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-6)


def test_window_batchnorm_under_torchrun_pools_statistics_over_the_ranks(tmp_path):
    # Converted before DDP wraps the model; each window's statistics are pooled over both ranks.
    text = train(["--model", "cnn-bn", "--bn", "window", "--limit-train", "256", "--limit-test",
                  "100", "--epochs", "1", "--no-progress", "--micro-batch", "16", "--steps", "2",
                  "--out", str(tmp_path / "bn")], tmp_path)
    assert text.count("Test: Accuracy") == 1
    epoch = next(r for r in read_metrics(tmp_path / "bn" / "metrics.jsonl") if r["kind"] == "epoch")
    assert epoch["optimizer_steps"] == 4  # 256 items / (16 x 2 x 2 ranks)


def test_under_torchrun_resume_of_a_folder_holding_only_a_killed_runs_lock_starts_over(tmp_path):
    # Only rank 0 takes the lock and sees that a killed run left it: every rank must start over.
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK).write_text('{"pid": 1, "host": "elsewhere", "started": 0}')  # no flock: a dead run's
    text = train(["--limit-train", "128", "--limit-test", "50", "--epochs", "1", "--no-progress",
                  "--out", str(out), "--resume"], tmp_path)
    assert f"No checkpoint in {out} yet: the run starts over" in text
    assert (out / "summary.json").exists() and not (out / LOCK).exists()
