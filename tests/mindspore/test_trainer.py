"""`gradaccum train --backend mindspore`: the seed's lines, the metrics, and the same result as
the torch backend from the same weights and data order."""

import pytest

pytest.importorskip("mindspore.nn", reason="needs MindSpore: pip install 'gradaccum[mindspore]'")

import json

import numpy as np
import torch

from gradaccum.cli import main
from gradaccum.demos.metrics import read_metrics

SMALL = ["--limit-train", "320", "--limit-test", "100", "--epochs", "1", "--no-progress"]


def test_mindspore_run_prints_the_seed_lines_and_writes_metrics(tmp_path, capsys):
    out = tmp_path / "ms"
    assert main(["train", "--backend", "mindspore", *SMALL, "--log-every", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "loss: " in text and "[  0/ 10]" in text and "[  8/ 10]" in text
    assert text.count("Test: Accuracy: ") == 1
    records = read_metrics(out / "metrics.jsonl")
    assert len([r for r in records if r["kind"] == "window"]) == 5  # 320 items / 64 per window
    assert next(r for r in records if r["kind"] == "epoch")["optimizer_steps"] == 5
    with np.load(out / "params.npz") as params:
        assert [params[k].shape for k in params.files] == [(512, 784), (512,), (512, 512), (512,),
                                                           (10, 512), (10,)]


@pytest.mark.slow  # whole MNIST runs on both backends
def test_compare_puts_the_backends_side_by_side_and_they_agree(tmp_path):
    out = tmp_path / "cmp"
    assert main(["compare", "--settings", "32x2", "--backends", "torch,mindspore", *SMALL,
                 "--out", str(out)]) == 0
    rows = json.loads((out / "compare.json").read_text())
    assert [r["setting"] for r in rows] == ["32x2-torch", "32x2-mindspore"]
    # Same weights, inputs and order: the backends differ by float32 rounding only.
    assert rows[1]["max_param_diff"] < 1e-5
    with np.load(out / "32x2-torch" / "params.npz") as a, np.load(out / "32x2-mindspore" / "params.npz") as b:
        for k in a.files:
            torch.testing.assert_close(torch.from_numpy(b[k]), torch.from_numpy(a[k]))


def test_a_partial_window_is_weighted_by_items_and_flushed(tmp_path):
    # 100 items in micro-batches of 32: the last holds 4 and the run weights by items.
    out = tmp_path / "run"
    assert main(["train", "--backend", "mindspore", "--limit-train", "100", "--limit-test", "50",
                 "--epochs", "1", "--no-progress", "--out", str(out)]) == 0
    epoch = next(r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "epoch")
    assert epoch["optimizer_steps"] == 2  # 1 full window + the flushed one


def test_settings_the_backend_does_not_run_are_refused(capsys):
    assert main(["train", "--backend", "mindspore", "--precision", "bf16", *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: --precision bf16: the mindspore backend trains in fp32" in err


@pytest.mark.slow  # whole MNIST runs on both backends
@pytest.mark.parametrize("bn", ["plain", "compound", "groupnorm"])
def test_cnn_bn_trains_on_mindspore_like_on_torch(tmp_path, bn):
    # Same weights, running statistics, momentum rule and data order: the backends differ by
    # float32 rounding only (convolutions and BatchNorm included).
    out = tmp_path / bn
    assert main(["compare", "--settings", "32x2", "--backends", "torch,mindspore", "--model", "cnn-bn",
                 "--bn", bn, *SMALL, "--out", str(out)]) == 0
    rows = json.loads((out / "compare.json").read_text())
    assert rows[1]["max_param_diff"] < 1e-4
    assert rows[0]["epochs"][-1]["test_accuracy"] == rows[1]["epochs"][-1]["test_accuracy"]


def test_window_batchnorm_is_refused_with_the_reason(capsys):
    assert main(["train", "--backend", "mindspore", "--model", "cnn-bn", "--bn", "window", *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--bn window runs on the torch backend only" in err
