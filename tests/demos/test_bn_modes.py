"""`gradaccum train --bn`: the BatchNorm treatments of the demo trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradaccum import Accumulator, WindowBatchNorm, scaled_momentum
from gradaccum.cli import main
from gradaccum.demos.config import BN_MODES
from gradaccum.demos.models import apply_bn_mode, build_model


def test_window_mode_commits_once_per_optimizer_step() -> None:
    model = build_model("cnn-bn", seed=0)
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.01), steps=4)
    model = apply_bn_mode(model, "window", acc)
    for xb in torch.randn(32, 1, 28, 28).split(4):
        acc.backward(model(xb).sum())
    layers = [m for m in model.modules() if isinstance(m, WindowBatchNorm)]
    assert len(layers) == 2 and all(int(m.num_batches_tracked) == 2 for m in layers)


def test_momentum_modes_use_the_accumulators_steps() -> None:
    model = build_model("cnn-bn", seed=0)
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.01), steps=4)
    apply_bn_mode(model, "linear", acc)
    assert model[1].momentum == pytest.approx(0.025)
    other = apply_bn_mode(build_model("cnn-bn"), "linear", None, steps=2)
    assert other[1].momentum == pytest.approx(0.05)
    with pytest.raises(ValueError, match="steps or an accumulator"):
        apply_bn_mode(build_model("cnn-bn"), "compound", None)
    with pytest.raises(ValueError, match="bn mode"):
        apply_bn_mode(build_model("cnn-bn"), "ghost", acc)


def test_momentum_modes_follow_a_steps_schedule() -> None:
    model = build_model("cnn-bn", seed=0)
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.01), steps={0: 2, 1: 4})
    model = apply_bn_mode(model, "compound", acc)
    assert model[1].momentum == pytest.approx(scaled_momentum(0.1, 2))
    for xb in torch.randn(12, 1, 28, 28).split(4):  # a window of 2, then one micro-batch of 4
        acc.backward(model(xb).sum())
    assert model[1].momentum == pytest.approx(scaled_momentum(0.1, 4))


def test_models_without_batchnorm_are_unchanged() -> None:
    model = build_model("cnn", seed=0)
    assert apply_bn_mode(model, "groupnorm", None) is model
    assert not any(isinstance(m, nn.GroupNorm) for m in model.modules())


def test_every_bn_mode_is_a_train_choice() -> None:
    from gradaccum.cli import build_parser

    for mode in BN_MODES:
        assert build_parser().parse_args(["train", "--bn", mode]).bn == mode


@pytest.mark.parametrize("mode", ["window", "groupnorm"])  # the two that replace layers
def test_train_runs_with_a_bn_mode(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--model", "cnn-bn", "--bn", mode, "--limit-train", "128", "--limit-test", "64",
            "--epochs", "1", "--micro-batch", "16", "--steps", "4", "--no-progress"]
    assert main(argv) == 0
    assert "Test: Accuracy: " in capsys.readouterr().out
