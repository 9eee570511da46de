"""`gradaccum train --backend mindspore`: the seed's lines, the metrics, and the same result as
the torch backend from the same weights and data order."""

import pytest

pytest.importorskip("mindspore.nn", reason="needs MindSpore: pip install 'gradaccum[mindspore]'")

import numpy as np
import torch

from gradaccum.cli import main
from gradaccum.demos.metrics import read_metrics

SMALL = ["--limit-train", "320", "--limit-test", "100", "--epochs", "1", "--no-progress"]


def test_mindspore_run_prints_the_seed_lines_and_matches_the_torch_run(tmp_path, capsys):
    ms_out, torch_out = tmp_path / "ms", tmp_path / "torch"
    assert main(["train", "--backend", "mindspore", *SMALL, "--log-every", "4", "--out", str(ms_out)]) == 0
    text = capsys.readouterr().out
    assert "loss: " in text and "[  0/ 10]" in text and "[  8/ 10]" in text
    assert text.count("Test: Accuracy: ") == 1
    records = read_metrics(ms_out / "metrics.jsonl")
    assert len([r for r in records if r["kind"] == "window"]) == 5  # 320 items / 64 per window
    assert next(r for r in records if r["kind"] == "epoch")["optimizer_steps"] == 5
    assert main(["train", *SMALL, "--out", str(torch_out)]) == 0
    with np.load(ms_out / "params.npz") as ours, np.load(torch_out / "params.npz") as theirs:
        assert ours.files == theirs.files
        for k in ours.files:
            torch.testing.assert_close(torch.from_numpy(ours[k]), torch.from_numpy(theirs[k]))


def test_a_partial_window_is_weighted_by_items_and_flushed(tmp_path):
    # 100 items in micro-batches of 32: the last holds 4 and the run weights by items.
    out = tmp_path / "run"
    assert main(["train", "--backend", "mindspore", "--limit-train", "100", "--limit-test", "50",
                 "--epochs", "1", "--no-progress", "--out", str(out)]) == 0
    epoch = next(r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "epoch")
    assert epoch["optimizer_steps"] == 2  # 1 full window + the flushed one


def test_settings_the_backend_does_not_run_are_refused():
    with pytest.raises(ValueError, match="precision='bf16'"):
        main(["train", "--backend", "mindspore", "--precision", "bf16", *SMALL])
