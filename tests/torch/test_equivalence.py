"""N micro-batches through the Accumulator == one full-batch step, against a plain reference."""

import itertools

import pytest
import torch
from torch import nn

import gradaccum
from tests.reference import (
    assert_params_close,
    bitwise_equal,
    clone_model,
    data,
    make_optimizer,
    mlp,
    reference_steps,
    snapshot,
)

WINDOWS = 5
MICRO = 4  # items per micro-batch


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 8])
def test_mean_weighting_equals_full_batch(steps, opt_name, dtype):
    model = mlp(dtype)
    ref = clone_model(model)
    x, y = data(WINDOWS * steps * MICRO, dtype)
    acc = gradaccum.Accumulator(make_optimizer(opt_name, model.parameters()), steps)
    stepped = [acc.backward(nn.functional.cross_entropy(model(xb), yb))
               for xb, yb in zip(x.split(MICRO), y.split(MICRO), strict=True)]
    reference_steps(ref, make_optimizer(opt_name, ref.parameters()),
                    list(zip(x.split(steps * MICRO), y.split(steps * MICRO), strict=True)))
    assert stepped == [(i + 1) % steps == 0 for i in range(WINDOWS * steps)]
    assert acc.optimizer_steps == WINDOWS and acc.micro_step == 0
    assert_params_close(model, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_uneven_micro_batches_weighted_by_items(opt_name, dtype):
    sizes = [[3, 5, 1, 7], [2, 2, 9, 3], [8, 1, 1, 6], [4, 4, 4, 4], [1, 13, 1, 1]]
    model = mlp(dtype)
    ref = clone_model(model)
    x, y = data(sum(map(sum, sizes)), dtype)
    acc = gradaccum.Accumulator(make_optimizer(opt_name, model.parameters()), 4)
    windows, start = [], 0
    for window in sizes:
        windows.append((x[start:start + sum(window)], y[start:start + sum(window)]))
        for n in window:
            xb, yb = x[start:start + n], y[start:start + n]
            acc.backward(nn.functional.cross_entropy(model(xb), yb), n_items=n)
            start += n
    reference_steps(ref, make_optimizer(opt_name, ref.parameters()), windows)
    assert_params_close(model, ref, dtype)


def test_uneven_micro_batches_without_items_are_not_the_full_batch():
    # The negative twin: the mean of micro-batch means differs when the sizes differ.
    model = mlp()
    ref = clone_model(model)
    x, y = data(16)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4)
    start = 0
    for n in (3, 5, 1, 7):
        acc.backward(nn.functional.cross_entropy(model(x[start:start + n]), y[start:start + n]))
        start += n
    reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), [(x, y)])
    with pytest.raises(AssertionError):
        assert_params_close(model, ref, torch.float64)


def test_gradients_1_2_3_4_give_exactly_2_5():
    for n_items in (None, 1):
        w = nn.Parameter(torch.zeros(()))
        acc = gradaccum.Accumulator(torch.optim.SGD([w], lr=1.0), 4)
        for g in (1.0, 2.0, 3.0, 4.0):
            acc.backward(w * g, n_items=n_items)
        assert w.item() == -2.5  # exact: SGD with lr 1 moves by the window's gradient


def test_parameters_bitwise_unchanged_mid_window():
    model = mlp(torch.float32)
    acc = gradaccum.Accumulator(torch.optim.AdamW(model.parameters(), lr=0.1), 4)
    x, y = data(16, torch.float32)
    before = snapshot(model)
    for i, (xb, yb) in enumerate(zip(x.split(4), y.split(4), strict=True)):
        acc.backward(nn.functional.cross_entropy(model(xb), yb))
        assert bitwise_equal(model, before) == (i < 3), f"after micro-batch {i + 1}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_clipping_equals_clipping_the_full_batch(dtype):
    model = mlp(dtype)
    ref = clone_model(model)
    x, y = data(3 * 4 * MICRO, dtype)
    acc = gradaccum.Accumulator(make_optimizer("sgd", model.parameters()), 4, clip_norm=0.05)
    for xb, yb in zip(x.split(MICRO), y.split(MICRO), strict=True):
        acc.backward(nn.functional.cross_entropy(model(xb), yb))
    reference_steps(ref, make_optimizer("sgd", ref.parameters()),
                    list(zip(x.split(4 * MICRO), y.split(4 * MICRO), strict=True)), clip_norm=0.05)
    assert acc.grad_norm is not None and float(acc.grad_norm) > 0.05  # clipping was active
    assert_params_close(model, ref, dtype)


def test_scheduler_steps_once_per_optimizer_step():
    model = mlp()
    ref = clone_model(model)
    opt = make_optimizer("sgd", model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_opt = make_optimizer("sgd", ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    acc = gradaccum.Accumulator(opt, 3, scheduler=sched)
    x, y = data(4 * 3 * MICRO)
    lrs = []
    for xb, yb in zip(x.split(MICRO), y.split(MICRO), strict=True):
        if acc.backward(nn.functional.cross_entropy(model(xb), yb)):
            lrs.append(opt.param_groups[0]["lr"])
    reference_steps(ref, ref_opt, list(zip(x.split(3 * MICRO), y.split(3 * MICRO), strict=True)),
                    scheduler=ref_sched)
    assert sched.last_epoch == acc.optimizer_steps == 4
    assert lrs == [0.05, 0.025, 0.0125, 0.00625]
    assert_params_close(model, ref, torch.float64)


@pytest.mark.parametrize("n_items", [False, True])
def test_flush_applies_the_partial_window_as_its_own_mean(n_items):
    model = mlp()
    ref = clone_model(model)
    x, y = data(10 * MICRO)
    acc = gradaccum.Accumulator(make_optimizer("adamw", model.parameters()), 4)
    for xb, yb in zip(x.split(MICRO), y.split(MICRO), strict=True):
        acc.backward(nn.functional.cross_entropy(model(xb), yb), n_items=MICRO if n_items else None)
    assert acc.micro_step == 2 and acc.optimizer_steps == 2
    assert acc.flush() is True
    assert acc.flush() is False  # nothing pending
    assert acc.micro_step == 0 and acc.optimizer_steps == 3
    bounds = [0, 16, 32, 40]
    reference_steps(ref, make_optimizer("adamw", ref.parameters()),
                    [(x[a:b], y[a:b]) for a, b in itertools.pairwise(bounds)])
    assert_params_close(model, ref, torch.float64)


def test_flush_of_an_empty_window_changes_nothing():
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    before = snapshot(model)
    assert acc.flush() is False
    assert bitwise_equal(model, before) and acc.optimizer_steps == 0


def test_window_loss_equals_the_full_batch_loss():
    model = mlp()
    ref = clone_model(model)
    x, y = data(2 * 13)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    losses, start = [], 0
    for n in (4, 6, 3, 5, 5, 3):
        acc.backward(nn.functional.cross_entropy(model(x[start:start + n]), y[start:start + n]),
                     n_items=n)
        start += n
        if acc.micro_step == 0:
            losses.append(float(acc.window_loss))
    ref_losses = reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                                 [(x[:13], y[:13]), (x[13:], y[13:])])
    assert losses == pytest.approx(ref_losses, abs=1e-12)


def test_multi_task_micro_batch_counts_once_and_equals_the_summed_loss():
    model = mlp()
    ref = clone_model(model)
    x, y = data(4 * MICRO)

    def task_losses(m, xb, yb):
        out = m(xb)
        return nn.functional.cross_entropy(out, yb), out.pow(2).mean()

    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    for xb, yb in zip(x.split(MICRO), y.split(MICRO), strict=True):
        with acc.micro_batch() as mb:
            mb.backward(task_losses(model, xb, yb)[0])  # first graph freed before the second
            mb.backward(task_losses(model, xb, yb)[1])
    assert acc.optimizer_steps == 2 and mb.stepped
    reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                    list(zip(x.split(2 * MICRO), y.split(2 * MICRO), strict=True)),
                    loss_fn=lambda out, yb: nn.functional.cross_entropy(out, yb) + out.pow(2).mean())
    assert_params_close(model, ref, torch.float64)


def test_grad_scaler_gives_the_same_update():
    model = mlp(torch.float32)
    ref = clone_model(model)
    x, y = data(4 * MICRO, torch.float32)
    acc = gradaccum.Accumulator(make_optimizer("sgd", model.parameters()), 2,
                                scaler=torch.amp.GradScaler("cpu"))
    for xb, yb in zip(x.split(MICRO), y.split(MICRO), strict=True):
        acc.backward(nn.functional.cross_entropy(model(xb), yb))
    reference_steps(ref, make_optimizer("sgd", ref.parameters()),
                    list(zip(x.split(2 * MICRO), y.split(2 * MICRO), strict=True)))
    assert acc.optimizer_steps == 2
    assert_params_close(model, ref, torch.float32)
