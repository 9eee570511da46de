"""The window loss: ``acc(grads, loss=loss)`` inside ``@ms.jit``, weighted like the gradient."""

import pytest

pytest.importorskip("mindspore.nn", reason="needs MindSpore: pip install 'gradaccum[mindspore]'")

import mindspore
import numpy as np
from mindspore import Tensor, nn

from gradaccum.mindspore import Accumulator
from tests.mindspore_reference import LOSS, data, grad_fn, net

MICRO = 4


def compiled(model, acc, weighted=False):
    """The seed's step shape, with the loss handed to the accumulator."""
    fn = grad_fn(model)

    if weighted:
        @mindspore.jit
        def step(xb, yb, n):
            loss, grads = fn(xb, yb)
            return loss, acc(grads, n, loss=loss)
    else:
        @mindspore.jit
        def step(xb, yb):
            loss, grads = fn(xb, yb)
            return loss, acc(grads, loss=loss)
    return step


def run(step, acc, x, y, sizes, weighted=False):
    """Feed micro-batches of ``sizes``; return (micro-batch losses, window losses at boundaries)."""
    acc_losses, micro_losses, start = [], [], 0
    for n in sizes:
        args = (x[start:start + n], y[start:start + n]) + ((Tensor(n, mindspore.int32),) if weighted else ())
        loss, stepped = step(*args)
        micro_losses.append(float(loss.asnumpy()))
        if bool(stepped):
            acc_losses.append(acc.window_loss)
        start += n
    return micro_losses, acc_losses


def test_window_loss_is_the_mean_of_the_micro_batch_losses_in_a_graph():
    x, y = data(3 * 2 * MICRO)
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), steps=2)
    step = compiled(model, acc)
    assert acc.window_loss is None  # before the first boundary
    micro, windows = run(step, acc, x, y, [MICRO] * 6)
    expected = [np.mean(micro[i:i + 2]) for i in range(0, 6, 2)]
    assert windows == pytest.approx(expected, rel=1e-6)
    # Equal micro-batches: it is also the full batch's loss (window 1, before any step).
    assert windows[0] == pytest.approx(float(LOSS(net()(x[:2 * MICRO]), y[:2 * MICRO]).asnumpy()), rel=1e-6)


def test_item_weighted_window_loss_is_the_full_batch_loss_not_the_mean_of_means():
    sizes = [1, 7, 2]
    x, y = data(sum(sizes))
    expected = float(LOSS(net()(x), y).asnumpy())
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), steps=3, weighting="items")
    step = compiled(model, acc, weighted=True)
    micro, (window,) = run(step, acc, x, y, sizes, weighted=True)
    assert window == pytest.approx(expected, rel=1e-6)
    assert float(np.mean(micro)) != pytest.approx(expected, rel=1e-3)  # the negative twin


def test_flushed_window_loss_is_the_mean_over_what_it_holds():
    x, y = data(3 * MICRO)
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), steps=2)
    fn = grad_fn(model)
    losses = []
    for i in range(3):  # eagerly: one full window, then one micro-batch
        loss, grads = fn(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO])
        losses.append(float(loss.asnumpy()))
        acc(grads, loss=loss)
    assert bool(acc.flush())
    assert acc.window_loss == pytest.approx(losses[2], rel=1e-6)


def test_discarded_micro_batches_leave_no_loss_behind():
    x, y = data(3 * MICRO)
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), steps=2)
    fn = grad_fn(model)
    loss, grads = fn(x[:MICRO], y[:MICRO])
    acc(grads, loss=loss * 100)
    acc.discard()
    losses = []
    for i in (1, 2):
        loss, grads = fn(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO])
        losses.append(float(loss.asnumpy()))
        acc(grads, loss=loss)
    assert acc.window_loss == pytest.approx(np.mean(losses), rel=1e-6)


def test_a_window_fed_partly_without_loss_has_no_window_loss():
    x, y = data(4 * MICRO)
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), steps=2)
    fn = grad_fn(model)
    loss, grads = fn(x[:MICRO], y[:MICRO])
    acc(grads, loss=loss)
    acc(fn(x[MICRO:2 * MICRO], y[MICRO:2 * MICRO])[1])  # no loss: the window's loss is unknown
    assert acc.optimizer_steps == 1 and acc.window_loss is None
    for i in (2, 3):  # the next window, fully reported, has one again
        loss, grads = fn(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO])
        acc(grads, loss=loss)
    assert acc.window_loss is not None


@pytest.mark.parametrize(("loss", "error", "message"), [
    (Tensor(np.ones(2, np.float32)), ValueError, r"loss must be a scalar .* shape \(2,?\)"),
    (Tensor(1, mindspore.int32), TypeError, "loss must be a float Tensor, got a Int32"),
    (1.5, TypeError, "loss must be the micro-batch's loss as a float Tensor, got float"),
])
def test_bad_loss_fails_the_compile_and_changes_nothing(loss, error, message):
    x, y = data(MICRO)
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), steps=2)
    fn = grad_fn(model)

    @mindspore.jit
    def step(xb, yb, value):
        return acc(fn(xb, yb)[1], loss=value)

    with pytest.raises(error, match=message):
        step(x, y, loss)
    assert acc.micro_step == 0
