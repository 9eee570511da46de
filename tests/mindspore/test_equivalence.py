"""The MindSpore Accumulator reproduces the full-batch step (float32 rounding only)."""

import pytest

ms = pytest.importorskip("mindspore.nn", reason="needs MindSpore: pip install 'gradaccum[mindspore]'")

import mindspore
import numpy as np
from mindspore import Tensor, nn

from gradaccum.mindspore import Accumulator
from tests.mindspore_reference import (
    TutorialAccumulator,
    assert_params_close,
    clip_,
    data,
    full_batch_steps,
    grad_fn,
    net,
    params,
    params_differ,
)


def windows(x, y, size):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def reference(windows_, clip_norm=None, optimizer=nn.Momentum, **opt_kw):
    model = net()
    opt = optimizer(model.trainable_params(), 0.1, **opt_kw)
    full_batch_steps(model, opt, windows_, clip_norm)
    return params(model)


def test_32x2_in_a_graph_matches_batch_64():
    # The seed's case, three windows, momentum: the optimizer runs once per window.
    x, y = data(3 * 64)
    model = net()
    acc = Accumulator(nn.Momentum(model.trainable_params(), 0.1, momentum=0.9), steps=2)
    fn = grad_fn(model)

    @mindspore.jit
    def train_step(xb, yb):
        _, grads = fn(xb, yb)
        return acc(grads)

    stepped = [bool(train_step(xb, yb)) for xb, yb in windows(x, y, 32)]
    assert stepped == [False, True] * 3
    assert (acc.optimizer_steps, acc.micro_step) == (3, 0)
    assert_params_close(params(model), reference(windows(x, y, 64), momentum=0.9))


def test_parameters_are_bitwise_unchanged_mid_window():
    x, y = data(3 * 8)
    model = net()
    before = params(model)
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), steps=3)
    fn = grad_fn(model)
    for xb, yb in windows(x, y, 8)[:2]:
        assert not bool(acc(fn(xb, yb)[1]))
        assert all(np.array_equal(a, b) for a, b in zip(params(model), before, strict=True))
    # The negative twin: stepping on every micro-batch changes them at once.
    naive = net()
    nn.SGD(naive.trainable_params(), 0.1)(grad_fn(naive)(x[:8], y[:8])[1])
    assert not all(np.array_equal(a, b) for a, b in zip(params(naive), before, strict=True))


def test_same_update_as_the_tutorials_class_without_dividing_the_loss():
    x, y = data(2 * 32)
    tutorial_model, ours = net(), net()
    tutorial = TutorialAccumulator(nn.SGD(tutorial_model.trainable_params(), 0.1), 2)
    tutorial_fn = grad_fn(tutorial_model)
    acc = Accumulator(nn.SGD(ours.trainable_params(), 0.1), 2)
    fn = grad_fn(ours)
    for xb, yb in windows(x, y, 16):
        # The tutorial's user divides each loss by N; ours takes the plain mean loss.
        tutorial(tuple(g / 2 for g in tutorial_fn(xb, yb)[1]))
        acc(fn(xb, yb)[1])
    assert_params_close(params(ours), params(tutorial_model))
    assert_params_close(params(ours), reference(windows(x, y, 32), optimizer=nn.SGD))


def test_flush_applies_a_short_window_as_its_own_mean():
    x, y = data(7 * 4)
    model = net()
    acc = Accumulator(nn.Momentum(model.trainable_params(), 0.1, momentum=0.9), steps=4)
    fn = grad_fn(model)
    for xb, yb in windows(x, y, 4):
        acc(fn(xb, yb)[1])
    assert acc.micro_step == 3
    assert bool(acc.flush())
    assert (acc.optimizer_steps, acc.micro_step) == (2, 0)
    assert not bool(acc.flush())  # nothing pending
    # Windows of 16 then 12 items: the short one is the mean over its 3 micro-batches.
    assert_params_close(params(model), reference([(x[:16], y[:16]), (x[16:], y[16:])], momentum=0.9))
    # The negative twin: dividing the short window by N = 4 (the tutorial's loss scaling).
    twin = net()
    opt = nn.Momentum(twin.trainable_params(), 0.1, momentum=0.9)
    full_batch_steps(twin, opt, [(x[:16], y[:16])])
    opt(tuple(g * 0.75 for g in grad_fn(twin)(x[16:], y[16:])[1]))
    assert params_differ(params(twin), params(model))


def test_items_weighting_is_the_mean_over_all_items():
    x, y = data(12)
    sizes = [5, 3, 4]  # one window of three uneven micro-batches
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), steps=3, weighting="items")
    fn = grad_fn(model)

    @mindspore.jit
    def train_step(xb, yb, n):
        return acc(fn(xb, yb)[1], n)

    start = 0
    for n in sizes:
        train_step(x[start:start + n], y[start:start + n], Tensor(n, mindspore.int32))
        start += n
    assert acc.optimizer_steps == 1
    expected = reference([(x, y)], optimizer=nn.SGD)
    assert_params_close(params(model), expected)
    # The negative twin: the mean of the three micro-batch means weights items unequally.
    twin = net()
    twin_acc = Accumulator(nn.SGD(twin.trainable_params(), 0.1), steps=3)
    twin_fn, start = grad_fn(twin), 0
    for n in sizes:
        twin_acc(twin_fn(x[start:start + n], y[start:start + n])[1])
        start += n
    assert params_differ(params(twin), expected)


def test_clip_norm_clips_the_window_gradient():
    x, y = data(2 * 16)
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), steps=2, clip_norm=0.05)
    fn = grad_fn(model)
    for xb, yb in windows(x, y, 16):
        acc(fn(xb, yb)[1])
    expected = reference([(x, y)], clip_norm=0.05, optimizer=nn.SGD)
    assert_params_close(params(model), expected)
    full_norm = float(np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum()
                                  for g in grad_fn(net())(x, y)[1])))
    assert acc.grad_norm == pytest.approx(full_norm, rel=1e-5)
    assert full_norm > 0.05  # so the clip did bite
    # The negative twin: the tutorial's class stores clip_norm and never applies it.
    tutorial_model = net()
    tutorial = TutorialAccumulator(nn.SGD(tutorial_model.trainable_params(), 0.1), 2, clip_norm=0.05)
    tutorial_fn = grad_fn(tutorial_model)
    for xb, yb in windows(x, y, 16):
        tutorial(tuple(g / 2 for g in tutorial_fn(xb, yb)[1]))
    assert params_differ(params(tutorial_model), expected)
    assert_params_close(params(tutorial_model), reference([(x, y)], optimizer=nn.SGD))


def test_clip_reference_is_torch_clip_grad_norm():
    # The test's own clipping matches torch.nn.utils.clip_grad_norm_ on the same numbers.
    import torch

    grads = [Tensor(np.array([3.0, 4.0], np.float32)), Tensor(np.array([12.0], np.float32))]
    tg = [torch.tensor([3.0, 4.0], requires_grad=True), torch.tensor([12.0], requires_grad=True)]
    for p, g in zip(tg, grads, strict=True):
        p.grad = torch.from_numpy(g.asnumpy().copy())
    torch.nn.utils.clip_grad_norm_(tg, 1.0)
    for ours, theirs in zip(clip_(grads, 1.0), tg, strict=True):
        np.testing.assert_allclose(ours.asnumpy(), theirs.grad.numpy(), rtol=1e-6)


def test_schedule_mapping_changes_n_at_the_boundary_in_a_graph():
    x, y = data(5 * 4)
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), steps={0: 2, 1: 3})
    fn = grad_fn(model)

    @mindspore.jit
    def train_step(xb, yb):
        return acc(fn(xb, yb)[1])

    stepped = [bool(train_step(xb, yb)) for xb, yb in windows(x, y, 4)]
    assert stepped == [False, True, False, False, True]
    assert acc.steps == 3
    assert_params_close(params(model), reference([(x[:8], y[:8]), (x[8:], y[8:])], optimizer=nn.SGD))


def test_discard_drops_the_partial_window():
    x, y = data(3 * 4)
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), steps=2)
    fn = grad_fn(model)
    acc(fn(x[:4], y[:4])[1])
    acc.discard()
    assert acc.micro_step == 0
    for xb, yb in windows(x[4:], y[4:], 4):
        acc(fn(xb, yb)[1])
    assert_params_close(params(model), reference([(x[4:], y[4:])], optimizer=nn.SGD))


def test_discard_after_a_nonfinite_micro_batch_leaves_nothing_behind():
    # The buffer is overwritten by a window's first micro-batch, never zeroed by arithmetic: a
    # NaN dropped with discard() cannot reach a later window (NaN - NaN would still be NaN).
    x, y = data(2 * 4)
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), steps=2)
    fn = grad_fn(model)
    good = fn(x[:4], y[:4])[1]
    acc(tuple(g * float("nan") for g in good))
    acc.discard()
    for xb, yb in windows(x, y, 4):
        acc(fn(xb, yb)[1])
    assert all(np.isfinite(p).all() for p in params(model))
    assert_params_close(params(model), reference([(x, y)], optimizer=nn.SGD))
