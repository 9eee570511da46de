"""`gradaccum train --steps-schedule`: N changes at window boundaries; the window loss is logged."""

import pytest

from gradaccum.cli import main
from gradaccum.demos.metrics import read_metrics
from tests.cli import run


def test_steps_schedule_changes_the_window_size(tmp_path, capsys):
    # 640 items in micro-batches of 32: 20 per epoch. Windows of 4 for the first 2 optimizer
    # steps (8 micro-batches), then windows of 2: 2 + 6 steps in epoch 1, 10 in epoch 2.
    out = tmp_path / "run"
    assert main(["train", "--steps-schedule", "0:4,2:2", "--limit-train", "640", "--limit-test",
                 "100", "--epochs", "2", "--no-progress", "--out", str(out)]) == 0
    assert "steps scheduled 0:4,2:2" in capsys.readouterr().out
    records = read_metrics(out / "metrics.jsonl")
    epochs = [r for r in records if r["kind"] == "epoch"]
    windows = [r for r in records if r["kind"] == "window"]
    assert [e["optimizer_steps"] for e in epochs] == [8, 18]
    assert len(windows) == 18 and all(w["loss"] > 0 for w in windows)
    assert [w["samples"] for w in windows[:4]] == [128, 256, 320, 384]


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps-schedule", "0:4,x:2"], "start 'x' is not an integer"),
    (["--steps-schedule", "0:4", "--steps", "2"], "replaces --steps"),
    (["--steps-schedule", "0:4", "--lr-rule", "linear"], "constant --steps"),
    (["--steps-schedule", "0:4", "--micro-batch", "0"], "argument --micro-batch"),
])
def test_bad_schedule_options_exit_with_a_message(argv, message, capsys):
    code, err = run(["train", *argv], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err
