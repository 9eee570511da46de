"""Checkpoints: a resume in the middle of a window is bit-exact."""

import io

import pytest
import torch
from torch import nn

import gradaccum
from tests.reference import data, mlp, snapshot

MICRO = 4


def build(model, steps=4, n_items=False):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    return opt, sched, gradaccum.Accumulator(opt, steps, scheduler=sched)


def feed(model, acc, x, y, n_items):
    for xb, yb in zip(x.split(MICRO), y.split(MICRO), strict=True):
        acc.backward(nn.functional.cross_entropy(model(xb), yb), n_items=len(xb) if n_items else None)


@pytest.mark.parametrize("n_items", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_resume_mid_window_is_bit_exact(n_items, dtype):
    x, y = data(11 * MICRO, dtype)
    cut = 6 * MICRO  # 1 full window + 2 of 4 micro-batches
    straight = mlp(dtype)
    _, _, acc = build(straight)
    feed(straight, acc, x, y, n_items)

    first = mlp(dtype)
    opt, sched, acc1 = build(first)
    feed(first, acc1, x[:cut], y[:cut], n_items)
    assert acc1.micro_step == 2
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "acc": acc1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    resumed = mlp(dtype, seed=123)  # different weights: everything must come from the checkpoint
    opt2, sched2, acc2 = build(resumed)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    acc2.load_state_dict(saved["acc"])
    assert (acc2.micro_step, acc2.optimizer_steps) == (2, 1)
    feed(resumed, acc2, x[cut:], y[cut:], n_items)
    assert acc2.optimizer_steps == acc.optimizer_steps == 2
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_resume_without_the_partial_gradients_is_not_exact():
    # The negative twin: dropping the saved .grad (what a plain checkpoint does) changes the result.
    x, y = data(8 * MICRO)
    straight = mlp()
    _, _, acc = build(straight)
    feed(straight, acc, x, y, False)
    first = mlp()
    _, _, acc1 = build(first)
    feed(first, acc1, x[:6 * MICRO], y[:6 * MICRO], False)
    state = acc1.state_dict()
    state["grads"] = [None for _ in state["grads"]]
    first.zero_grad(set_to_none=True)
    acc1.load_state_dict(state)
    feed(first, acc1, x[6 * MICRO:], y[6 * MICRO:], False)
    assert not all(torch.equal(a, b) for a, b in zip(straight.parameters(), first.parameters(), strict=True))


def test_state_dict_is_a_snapshot():
    model = mlp()
    _, _, acc = build(model)
    x, y = data(2 * MICRO)
    feed(model, acc, x[:MICRO], y[:MICRO], False)
    state = acc.state_dict()
    saved = [g.clone() for g in state["grads"]]
    feed(model, acc, x[MICRO:], y[MICRO:], False)  # adds into the live .grad
    assert all(torch.equal(a, b) for a, b in zip(state["grads"], saved, strict=True))


def test_load_state_from_other_steps_is_refused_and_changes_nothing():
    model = mlp()
    _, _, acc = build(model, steps=4)
    x, y = data(MICRO)
    feed(model, acc, x, y, False)
    other_model = mlp()
    _, _, other = build(other_model, steps=2)
    grads_before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="steps=2"):
        acc.load_state_dict(other.state_dict())
    assert acc.micro_step == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads_before, strict=True))


def test_load_state_from_other_parameters_is_refused():
    model = mlp()
    _, _, acc = build(model)
    small = nn.Linear(2, 2)
    _, _, other = build(small)
    with pytest.raises(ValueError, match="other parameters"):
        acc.load_state_dict(other.state_dict())
    with pytest.raises(TypeError, match="state"):
        acc.load_state_dict({"foo": 1})
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())


def _partial_state(n_items):
    """A fresh accumulator's target and a state holding one micro-batch of two (item-weighted
    under a GradScaler, so the window has a provisional total)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    acc = gradaccum.Accumulator(opt, 2, scaler=scaler)
    x, y = data(MICRO)
    acc.backward(nn.functional.cross_entropy(model(x), y), n_items)
    state = acc.state_dict()
    del acc
    target = gradaccum.Accumulator(opt, 2, scaler=scaler)
    return model, target, state


@pytest.mark.parametrize("field, value, message", [
    ("scale", torch.tensor(0.0), r"state\['window'\]\['scale'\] must be > 0"),
    ("scale", 0, r"state\['window'\]\['scale'\] must be None or a number > 0"),
    ("size", 2**70, r"state\['window'\]\['size'\] is 1180591620717411303424, but steps=2 gives 2"),
    ("size", 3, r"state\['window'\]\['size'\] is 3, but steps=2 gives 2"),
])
def test_a_state_whose_window_cannot_be_right_is_refused_before_any_change(field, value, message):
    # A zero provisional total made the next boundary's parameters NaN; a window of 2**70 never
    # stepped again; a size other than steps completed early or late (all accepted before).
    model, target, state = _partial_state(torch.tensor(3))
    state["window"][field] = value
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    assert target.micro_step == 0 and target.steps == 2
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


@pytest.mark.parametrize("n_items, message", [
    (torch.tensor(2**53 + 1), "beyond float64's exact integer range"),  # the int was refused already
    (torch.tensor(3, device="meta"), "n_items must be a dense tensor with a value"),
])
def test_tensor_counts_are_checked_like_numbers(n_items, message):
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    x, y = data(MICRO)
    with pytest.raises(ValueError, match=message):
        acc.backward(nn.functional.cross_entropy(model(x), y), n_items)
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())


# -- a state the accumulator wrote always loads (a window keeps the size it opened with) ----------

def _run(steps, ops, reload_after=()):
    """Feed ``ops`` ("feed", ("epoch", e), ("resize", n)) to a fresh SGD accumulator, reloading its
    state (through torch.save) into a new one after each op whose index is in ``reload_after``;
    returns the parameters and what each feed returned."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(opt, steps)
    x, y = data(MICRO * 12)
    batches = iter(zip(x.split(MICRO), y.split(MICRO), strict=True))
    returned = []
    for i, op in enumerate(ops):
        if op == "feed":
            xb, yb = next(batches)
            returned.append(acc.backward(nn.functional.cross_entropy(model(xb), yb)))
        elif op[0] == "epoch":
            acc.set_epoch(op[1])
        else:
            acc.resize_window(op[1])
        if i in reload_after:
            buf = io.BytesIO()
            torch.save(acc.state_dict(), buf)
            del acc
            buf.seek(0)
            acc = gradaccum.Accumulator(opt, steps)
            acc.load_state_dict(torch.load(buf, weights_only=True))
    return snapshot(model), returned, (acc.optimizer_steps, acc.micro_step, acc.steps)


@pytest.mark.parametrize("steps, ops, cut", [
    # the cases: an epoch schedule's window carried into the epoch that gives 2 ...
    (gradaccum.Schedule({0: 3, 1: 2}, by="epoch"), ["feed", ("epoch", 1), "feed", "feed", "feed", "feed"], 1),
    # ... and AutoBatch's resize, then one micro-batch (saved with 1 of 5, built with steps=2)
    (2, [("resize", 5), "feed", "feed", "feed", "feed", "feed", "feed", "feed"], 1),
    (2, [("resize", 5), "feed", "feed", "feed", "feed", "feed", "feed", "feed"], 0),  # empty, resized
    (gradaccum.Schedule({0: 3, 1: 2}, by="epoch"), ["feed", "feed", ("epoch", 1), "feed", "feed"], 2),
])
def test_a_state_written_mid_window_after_set_epoch_or_resize_loads_and_resumes_bitwise(steps, ops, cut):
    # Refused in 0.3.0 ("size is 3, but steps=... gives 2 at epoch 1"); the window completes at the
    # size it opened with, and the next one reads the schedule, as in a run that never stopped.
    straight, fed, end = _run(steps, ops)
    resumed, fed_resumed, end_resumed = _run(steps, ops, reload_after=(cut,))
    assert fed_resumed == fed and end_resumed == end
    assert sum(fed) == end[0] >= 1
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


def test_the_resumed_windows_take_their_sizes_from_where_they_opened():
    _, fed, end = _run(gradaccum.Schedule({0: 3, 1: 2}, by="epoch"),
                       ["feed", ("epoch", 1), "feed", "feed", "feed", "feed"], reload_after=(1,))
    assert fed == [False, False, True, False, True] and end == (2, 0, 2)  # 3, then 2
    _, fed, end = _run(2, [("resize", 5)] + ["feed"] * 7, reload_after=(1,))
    assert fed == [False] * 4 + [True, False, True] and end == (2, 0, 2)  # 5, then 2


def _older(state, version):
    """``state`` as gradaccum 0.3.0 (no ``opened_at``) or 0.2.0 (no ``basis`` either; the loss
    sum saved times 1/N) wrote it."""
    state = {**state, "window": dict(state["window"])}
    del state["window"]["opened_at"]
    if version == "0.2.0":
        del state["window"]["basis"], state["window"]["scale"], state["window"]["terms"]
        state["loss_sum"] = state["loss_sum"] / state["window"]["size"]
    return state


@pytest.mark.parametrize("version", ["0.3.0", "0.2.0"])
def test_states_written_before_the_opening_count_was_recorded_still_load_bitwise(version):
    x, y = data(8 * MICRO)
    straight = mlp()
    _, _, acc = build(straight)
    feed(straight, acc, x, y, False)
    first = mlp()
    opt, sched, acc1 = build(first)
    feed(first, acc1, x[:6 * MICRO], y[:6 * MICRO], False)
    state = _older(acc1.state_dict(), version)
    del acc1
    opt.zero_grad(set_to_none=True)
    acc2 = gradaccum.Accumulator(opt, 4, scheduler=sched)
    acc2.load_state_dict(state)
    assert (acc2.micro_step, acc2.steps) == (2, 4)
    feed(first, acc2, x[6 * MICRO:], y[6 * MICRO:], False)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), first.parameters(), strict=True))
    assert torch.equal(acc2.window_loss, acc.window_loss)


@pytest.mark.parametrize("value, kind, message", [
    (-1, ValueError, r"state\['window'\]\['opened_at'\] must be a non-negative integer"),
    ("0", TypeError, r"state\['window'\]\['opened_at'\]"),
    (1, ValueError, r"state\['window'\]\['size'\] is 3, but steps=.* gives 2 at epoch 1, where the "
                    "window opened"),
])
def test_an_edited_opening_count_is_refused_before_any_change(value, kind, message):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = gradaccum.Schedule({0: 3, 1: 2}, by="epoch")
    acc = gradaccum.Accumulator(opt, steps)
    x, y = data(MICRO)
    acc.backward(nn.functional.cross_entropy(model(x), y))
    acc.set_epoch(1)
    state = acc.state_dict()
    state["window"]["opened_at"] = value
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(kind, match=message):
        acc.load_state_dict(state)
    assert (acc.micro_step, acc.steps) == (1, 3)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
