"""The window loss: the window's loss weighted like its gradient, kept on the device."""

import itertools

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import gradaccum
from tests.reference import clone_model, data, mlp, reference_steps

MICRO = 4
# Tensor methods that copy a value to the host (a GPU synchronization on a device tensor).
HOST_READS = {"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy", "cpu"}


def run(model, acc, x, y, sizes, n_items):
    """Feed micro-batches of ``sizes`` items; return the window loss after every optimizer step."""
    losses, start = [], 0
    for n in sizes:
        loss = nn.functional.cross_entropy(model(x[start:start + n]), y[start:start + n])
        if acc.backward(loss, n_items=n if n_items else None):
            losses.append(acc.window_loss)
        start += n
    return losses


def full_batch_losses(model, x, y, window_items):
    bounds = [0, *itertools.accumulate(window_items)]
    return reference_steps(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           [(x[a:b], y[a:b]) for a, b in itertools.pairwise(bounds)])


def test_mean_weighted_window_loss_equals_the_full_batch_loss():
    model = mlp()
    ref = clone_model(model)
    x, y = data(3 * 4 * MICRO)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4)
    losses = run(model, acc, x, y, [MICRO] * 12, n_items=False)
    assert all(loss.dim() == 0 and loss.dtype == torch.float64 for loss in losses)
    expected = full_batch_losses(ref, x, y, [4 * MICRO] * 3)
    assert [float(v) for v in losses] == pytest.approx(expected, abs=1e-12, rel=0)


def test_item_weighted_window_loss_is_not_the_mean_of_micro_batch_means():
    # With uneven micro-batches only the item weighting gives the full-batch loss.
    sizes = [1, 7, 2, 6]
    x, y = data(sum(sizes))
    expected = full_batch_losses(mlp(), x, y, [sum(sizes)])
    for n_items, equal in ((True, True), (False, False)):
        model = mlp()
        acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4)
        (loss,) = run(model, acc, x, y, sizes, n_items)
        assert (float(loss) == pytest.approx(expected[0], abs=1e-12, rel=0)) is equal


@pytest.mark.parametrize("n_items", [False, True])
def test_flushed_window_loss_is_the_mean_over_what_it_holds(n_items):
    model = mlp()
    ref = clone_model(model)
    sizes = [3, 5, 4, 2, 6, 1] if n_items else [MICRO] * 6  # one window of 4, then 2 flushed
    x, y = data(sum(sizes))
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4)
    losses = run(model, acc, x, y, sizes, n_items)
    assert acc.flush()
    losses.append(acc.window_loss)
    windows = [sum(sizes[:4]), sum(sizes[4:])]
    assert [float(v) for v in losses] == pytest.approx(full_batch_losses(ref, x, y, windows),
                                                       abs=1e-12, rel=0)


def test_window_loss_follows_a_schedule_change():
    model = mlp()
    ref = clone_model(model)
    x, y = data(10 * MICRO)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), {0: 4, 1: 2, 2: 3})
    losses = run(model, acc, x, y, [MICRO] * 10, n_items=False)
    assert acc.micro_step == 1 and acc.flush()  # the tenth micro-batch alone
    losses.append(acc.window_loss)
    expected = full_batch_losses(ref, x, y, [4 * MICRO, 2 * MICRO, 3 * MICRO, MICRO])
    assert [float(v) for v in losses] == pytest.approx(expected, abs=1e-12, rel=0)


def test_window_loss_is_the_unscaled_loss_under_a_grad_scaler():
    model = mlp(torch.float32)
    ref = clone_model(model)
    x, y = data(4 * MICRO, torch.float32)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4,
                                scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 16))
    (loss,) = run(model, acc, x, y, [MICRO] * 4, n_items=False)
    torch.testing.assert_close(float(loss), full_batch_losses(ref, x, y, [4 * MICRO])[0])


def test_window_loss_is_none_before_the_first_step():
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    x, y = data(MICRO)
    acc.backward(nn.functional.cross_entropy(model(x), y))
    assert acc.window_loss is None


class HostReads(TorchFunctionMode):
    """Records every tensor method that would copy a value back to the host."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def test_host_read_recorder_sees_item():
    # The negative twin: what the hot path must not do is seen by the recorder.
    with HostReads() as reads:
        float(torch.ones(()).sum())
        torch.ones(()).item()
    assert reads.calls == ["__float__", "item"]


@pytest.mark.parametrize("n_items", [False, True])
def test_no_value_is_read_back_to_the_host_on_a_micro_step_or_a_boundary(n_items):
    model = mlp()
    x, y = data(8 * MICRO)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4)
    with HostReads() as reads:
        for xb, yb in zip(x.split(MICRO), y.split(MICRO), strict=True):
            acc.backward(nn.functional.cross_entropy(model(xb), yb), n_items=MICRO if n_items else None)
    assert acc.optimizer_steps == 2
    assert reads.calls == []
    assert isinstance(acc.window_loss, torch.Tensor) and acc.window_loss.dim() == 0
