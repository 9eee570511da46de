"""Checkpoints: a resume in the middle of a window is bit-exact; foreign states are refused."""

import pickle

import pytest

pytest.importorskip("mindspore.nn", reason="needs MindSpore: pip install 'gradaccum[mindspore]'")

import numpy as np
from mindspore import Tensor, nn

from gradaccum import Schedule
from gradaccum.mindspore import Accumulator
from tests.mindspore_reference import data, grad_fn, net, params

MICRO = 4


def build(model, steps=3, weighting="mean"):
    opt = nn.Momentum(model.trainable_params(), 0.1, momentum=0.9)
    return opt, Accumulator(opt, steps, weighting=weighting)


def feed(model, acc, x, y, weighting):
    fn = grad_fn(model)
    for i in range(0, len(x), MICRO):
        grads = fn(x[i:i + MICRO], y[i:i + MICRO])[1]
        acc(grads) if weighting == "mean" else acc(grads, Tensor(MICRO))


def copy_cell(src, dst):
    for name, p in src.parameters_and_names():
        dict(dst.parameters_and_names())[name].set_data(Tensor(p.asnumpy().copy()))


@pytest.mark.parametrize("weighting", ["mean", "items"])
def test_resume_mid_window_is_bit_exact(weighting):
    x, y = data(8 * MICRO)
    cut = 5 * MICRO  # one window of 3, then 2 of 3
    straight = net()
    _, acc = build(straight, weighting=weighting)
    feed(straight, acc, x, y, weighting)

    first = net()
    opt, acc1 = build(first, weighting=weighting)
    feed(first, acc1, x[:cut], y[:cut], weighting)
    assert (acc1.micro_step, acc1.optimizer_steps) == (2, 1)
    saved = pickle.loads(pickle.dumps({"acc": acc1.state_dict(), "net": params(first)}))

    resumed = net(seed=123)  # other weights: everything must come from the checkpoint
    opt2, acc2 = build(resumed, weighting=weighting)
    for p, value in zip(resumed.trainable_params(), saved["net"], strict=True):
        p.set_data(Tensor(value))
    copy_cell(opt, opt2)  # the optimizer's own state (momentum) is the user's to save
    acc2.load_state_dict(saved["acc"])
    assert (acc2.micro_step, acc2.optimizer_steps) == (2, 1)
    assert acc2.window == acc1.window
    feed(resumed, acc2, x[cut:], y[cut:], weighting)
    assert acc2.optimizer_steps == acc.optimizer_steps == 2
    assert all(np.array_equal(a, b) for a, b in zip(params(straight), params(resumed), strict=True))


def test_resume_without_the_partial_gradients_is_not_exact():
    # The negative twin: a checkpoint without the buffer (what a plain model checkpoint holds).
    x, y = data(6 * MICRO)
    straight = net()
    _, acc = build(straight)
    feed(straight, acc, x, y, "mean")
    first = net()
    opt, acc1 = build(first)
    feed(first, acc1, x[:4 * MICRO], y[:4 * MICRO], "mean")
    state = acc1.state_dict()
    state["grads"] = [np.zeros_like(g) for g in state["grads"]]
    resumed = net()
    opt2, acc2 = build(resumed)
    for p, value in zip(resumed.trainable_params(), params(first), strict=True):
        p.set_data(Tensor(value))
    copy_cell(opt, opt2)
    acc2.load_state_dict(state)
    feed(resumed, acc2, x[4 * MICRO:], y[4 * MICRO:], "mean")
    assert not all(np.array_equal(a, b) for a, b in zip(params(straight), params(resumed), strict=True))


def test_state_records_the_window_like_the_core():
    x, y = data(2 * MICRO)
    model = net()
    _, acc = build(model, steps=3, weighting="items")
    feed(model, acc, x, y, "items")
    state = acc.state_dict()
    assert state["window"] == {"size": 3, "micro_step": 2, "weighting": "items", "items": 2 * MICRO}
    assert state["steps"] == 3 and state["version"] == 1
    assert [g.shape for g in state["grads"]] == [tuple(p.shape) for p in model.trainable_params()]


def test_foreign_states_are_refused_before_anything_changes():
    x, y = data(MICRO)
    model = net()
    _, acc = build(model, steps=3)
    feed(model, acc, x, y, "mean")
    good = acc.state_dict()
    with pytest.raises(TypeError, match="state must be a dict"):
        acc.load_state_dict([1, 2])
    with pytest.raises(ValueError, match="saved with steps=3, this accumulator has steps=2"):
        build(net(), steps=2)[1].load_state_dict(good)
    with pytest.raises(ValueError, match="weighting='mean', this accumulator has weighting='items'"):
        build(net(), steps=3, weighting="items")[1].load_state_dict(good)
    other = nn.SequentialCell(nn.Dense(6, 5), nn.Tanh(), nn.Dense(5, 3))
    fresh = Accumulator(nn.SGD(other.trainable_params(), 0.1), 3)
    with pytest.raises(ValueError, match="other parameters"):
        fresh.load_state_dict(good)
    assert fresh.micro_step == 0


def test_epoch_schedule_takes_effect_at_the_boundary():
    x, y = data(6 * MICRO)
    model = net()
    _, acc = build(model, steps=Schedule({0: 2, 1: 3}, by="epoch"))
    assert acc.steps == 2
    feed(model, acc, x[:MICRO], y[:MICRO], "mean")
    acc.set_epoch(1)  # a window is open: it keeps N = 2
    assert acc.steps == 2
    feed(model, acc, x[MICRO:2 * MICRO], y[MICRO:2 * MICRO], "mean")
    assert (acc.optimizer_steps, acc.steps) == (1, 3)
    acc.set_epoch(0)  # an empty window takes the new N at once
    assert acc.steps == 2
