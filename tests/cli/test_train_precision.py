"""`gradaccum train --precision bf16`: autocast forward, skipped windows counted in the metrics."""

import json

import numpy as np

from gradaccum.cli import main
from gradaccum.demos.config import TrainConfig
from gradaccum.demos.metrics import read_metrics
from gradaccum.demos.trainer import run_torch

SMALL = ["--limit-train", "640", "--limit-test", "200", "--epochs", "2", "--no-progress"]


def epochs_of(out):
    return [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "epoch"]


def test_bf16_autocast_trains_close_to_fp32_but_not_identically():
    runs = {}
    for precision in ("fp32", "bf16"):
        config = TrainConfig(limit_train=320, limit_test=50, epochs=1, progress=False,
                             precision=precision)
        result = run_torch(config, log=lambda line: None)
        assert [(e.optimizer_steps, e.skipped_windows) for e in result.epochs] == [(5, 0)]
        runs[precision] = result.final_params
    diffs = [float(np.abs(a - b).max()) for a, b in zip(runs["fp32"], runs["bf16"], strict=True)]
    assert 0 < max(diffs) < 1e-2  # the forward ran in bf16: close, and not the fp32 run


def test_bf16_run_skips_and_counts_diverged_windows(tmp_path):
    # lr 1e30: the first step blows the weights up; every later window's gradient is NaN and is
    # skipped instead of being applied.
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--precision", "bf16", "--lr", "1e30", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["config"]["precision"] == "bf16"
    last = epochs_of(out)[-1]
    assert last["optimizer_steps"] >= 1 and last["skipped_windows"] >= 1
    assert last["optimizer_steps"] + last["skipped_windows"] == 20
