"""`gradaccum train` and `compare` on a small subset (seconds), and the files they write."""

import json

import numpy as np
import pytest

from gradaccum.cli import main
from gradaccum.cli.compare import parse_settings
from gradaccum.demos.metrics import read_metrics
from tests.cli import run

SMALL = ["--limit-train", "640", "--limit-test", "200", "--epochs", "2", "--no-progress"]


def test_train_prints_the_seed_lines_and_writes_metrics(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--log-every", "5", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "micro-batch 32 x steps 2 = batch 64" in text
    assert "loss: " in text and "[  0/ 20]" in text and "[  5/ 20]" in text
    assert text.count("Test: Accuracy: ") == 2
    records = read_metrics(out / "metrics.jsonl")
    windows = [r for r in records if r["kind"] == "window"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert len(windows) == 2 * 10  # 640 items / 64 per window, two epochs
    assert windows[-1]["samples"] == 2 * 640
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert epochs[-1]["optimizer_steps"] == 20
    assert epochs[0]["train_loss"] == pytest.approx(np.mean([w["loss"] for w in windows[:10]]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["micro_batch"] == 32 and summary["config"]["steps"] == 2
    assert summary["epochs"][1]["test_accuracy"] == epochs[1]["test_accuracy"]
    assert (out / "curves.png").stat().st_size > 1000
    with np.load(out / "params.npz") as params:
        assert len(params.files) == 6  # three linear layers


def test_global_batch_and_partial_last_window(tmp_path, capsys):
    # 600 items in windows of 64: the last window holds 24 items (a micro-batch of 24 weighted
    # by its items) and is flushed at the end of the epoch.
    out = tmp_path / "run"
    assert main(["train", "--limit-train", "600", "--limit-test", "100", "--epochs", "1",
                 "--no-progress", "--global-batch", "64", "--micro-batch", "16", "--out", str(out)]) == 0
    assert "micro-batch 16 x steps 4 = batch 64" in capsys.readouterr().out
    epoch = next(r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "epoch")
    assert epoch["optimizer_steps"] == 10  # 9 full windows + the flushed one


def test_carry_keeps_the_partial_window_across_epochs(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--limit-train", "96", "--limit-test", "50", "--epochs", "2",
                 "--no-progress", "--end-of-epoch", "carry", "--out", str(out)]) == 0
    epochs = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "epoch"]
    # 3 micro-batches per epoch, 2 per window: 1 window in epoch 1, then 2 (one spans the epochs).
    assert [e["optimizer_steps"] for e in epochs] == [1, 3]


@pytest.mark.parametrize("argv, message", [
    (["--global-batch", "64", "--micro-batch", "32", "--steps", "4"], "global batch 64"),
    (["--global-batch", "60", "--steps", "8"], "not divisible"),
    (["--micro-batch", "0"], "argument --micro-batch: must be an integer >= 1, got '0'"),
])
def test_bad_batch_options_exit_with_a_message(argv, message, capsys):
    code, err = run(["train", *argv], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err


@pytest.mark.slow
def test_compare_runs_each_setting_and_matches_the_large_batch(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--settings", "64x1,32x2,16x4", *SMALL, "--out", str(out)]) == 0
    rows = json.loads((out / "compare.json").read_text())
    assert [r["setting"] for r in rows] == ["64x1", "32x2", "16x4"]
    assert rows[0]["max_param_diff"] == 0.0
    for row in rows[1:]:
        assert row["max_param_diff"] < 1e-5  # float32 rounding only
        assert [e["test_accuracy"] for e in row["epochs"]] == [
            e["test_accuracy"] for e in rows[0]["epochs"]]
    table = capsys.readouterr().out
    assert "| 32x2 |" in table and (out / "compare.png").exists()


def test_settings_are_validated():
    assert parse_settings("8x8") == [(8, 8)]
    for bad in ("8", "8x0", "x2", "8x2.5", "064x1", "8x+2", "\u0668x2"):  # counts written plainly
        with pytest.raises(ValueError, match="MICROxSTEPS"):
            parse_settings(bad)
    assert parse_settings("8x8,8x4,4x8") == [(8, 8), (8, 4), (4, 8)]  # distinct: each runs once
    with pytest.raises(ValueError, match="gives 8x8 twice: each setting runs once"):
        parse_settings("8x8,8x4,8x8")
