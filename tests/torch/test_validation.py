"""Bad input: a clear error naming the argument and its value, before any state changes."""

import pytest
import torch
from torch import nn

import gradaccum
from tests.reference import data, mlp


def fresh(steps=2, **kwargs):
    model = mlp()
    return model, gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps, **kwargs)


@pytest.mark.parametrize("steps", [0, -1, 2.5, "2", True, None])
def test_bad_steps(steps):
    model = mlp()
    with pytest.raises((TypeError, ValueError), match="steps") as info:
        gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps)
    assert repr(steps) in str(info.value)


@pytest.mark.parametrize("clip_norm", [0, -1.0, float("nan"), "1", True])
def test_bad_clip_norm(clip_norm):
    model = mlp()
    with pytest.raises((TypeError, ValueError), match="clip_norm"):
        gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, clip_norm=clip_norm)


def test_bad_parts():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="optimizer"):
        gradaccum.Accumulator(model.parameters(), 2)
    with pytest.raises(TypeError, match="model"):
        gradaccum.Accumulator(opt, 2, model=opt)
    with pytest.raises(TypeError, match="scheduler"):
        gradaccum.Accumulator(opt, 2, scheduler=object())
    other = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="scheduler"):
        gradaccum.Accumulator(opt, 2, scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    with pytest.raises(TypeError, match="scaler"):
        gradaccum.Accumulator(opt, 2, scaler="amp")


def state_of(model, acc):
    return acc.micro_step, acc.optimizer_steps, [
        None if p.grad is None else p.grad.clone() for p in model.parameters()]


def same(a, b):
    return a[:2] == b[:2] and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a[2], b[2], strict=True))


@pytest.mark.parametrize("n_items, error", [
    (0, ValueError), (-3, ValueError), (-0.5, ValueError), (float("nan"), ValueError),
    (float("inf"), ValueError), (10**40, ValueError), (True, TypeError), ("4", TypeError),
    (torch.tensor(0), ValueError), (torch.tensor(float("nan")), ValueError),
    (torch.tensor(1 + 1j), TypeError), (torch.tensor([1, 2]), ValueError),
])
def test_bad_n_items_changes_nothing(n_items, error):
    model, acc = fresh()
    x, y = data(8)
    acc.backward(nn.functional.cross_entropy(model(x[:4]), y[:4]), n_items=4)
    before = state_of(model, acc)
    with pytest.raises(error, match="n_items") as info:
        acc.backward(nn.functional.cross_entropy(model(x[4:]), y[4:]), n_items=n_items)
    if not isinstance(n_items, torch.Tensor):
        assert repr(n_items) in str(info.value)
    assert same(before, state_of(model, acc))


@pytest.mark.parametrize("make_loss, error, match", [
    (lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"), ValueError, "scalar"),
    (lambda out, y: nn.functional.cross_entropy(out, y).detach(), ValueError, "require grad"),
    (lambda out, y: 1.0, TypeError, "loss must be a torch.Tensor"),
])
def test_bad_loss_changes_nothing(make_loss, error, match):
    model, acc = fresh()
    x, y = data(8)
    acc.backward(nn.functional.cross_entropy(model(x[:4]), y[:4]))
    before = state_of(model, acc)
    with pytest.raises(error, match=match):
        acc.backward(make_loss(model(x[4:]), y[4:]))
    assert same(before, state_of(model, acc))


def test_mixing_weightings_changes_nothing():
    model, acc = fresh(steps=3)
    x, y = data(8)
    acc.backward(nn.functional.cross_entropy(model(x[:4]), y[:4]))
    before = state_of(model, acc)
    with pytest.raises(ValueError, match="n_items=4"):
        acc.backward(nn.functional.cross_entropy(model(x[4:]), y[4:]), n_items=4)
    assert same(before, state_of(model, acc))
