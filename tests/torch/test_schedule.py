"""Accumulation schedules: N changes only at a window boundary; counters, the LR scheduler and
checkpoints stay consistent across a change."""

import io
import itertools

import pytest
import torch
from torch import nn

import gradaccum
from gradaccum import Schedule
from tests.reference import assert_params_close, clone_model, data, mlp, reference_steps

MICRO = 4  # items per micro-batch


def micro_batches(x, y):
    return list(zip(x.split(MICRO), y.split(MICRO), strict=True))


def windows_of(x, y, sizes):
    """The full batches of windows of ``sizes`` micro-batches each."""
    bounds = [0, *itertools.accumulate(n * MICRO for n in sizes)]
    return [(x[a:b], y[a:b]) for a, b in itertools.pairwise(bounds)]


def sgd_with_halving_lr(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def test_schedule_4_then_2_gives_its_window_sizes_steps_and_lrs():
    model = mlp()
    ref = clone_model(model)
    x, y = data(16 * MICRO)
    opt, sched = sgd_with_halving_lr(model)
    acc = gradaccum.Accumulator(opt, {0: 4, 2: 2}, scheduler=sched)
    stepped, lrs, sizes = [], [], []
    for xb, yb in micro_batches(x, y):
        size = acc.steps
        stepped.append(acc.backward(nn.functional.cross_entropy(model(xb), yb)))
        if stepped[-1]:
            sizes.append(size)
            lrs.append(opt.param_groups[0]["lr"])
    assert sizes == [4, 4, 2, 2, 2, 2]
    assert [i + 1 for i, s in enumerate(stepped) if s] == [4, 8, 10, 12, 14, 16]
    assert acc.optimizer_steps == sched.last_epoch == 6 and acc.micro_step == 0
    assert lrs == [0.1 * 0.5 ** k for k in range(1, 7)]
    ref_opt, ref_sched = sgd_with_halving_lr(ref)
    reference_steps(ref, ref_opt, windows_of(x, y, sizes), scheduler=ref_sched)
    assert_params_close(model, ref, torch.float64)


def test_schedule_is_not_the_constant_window():
    # The negative twin: the same data in constant windows of 4 is another training run.
    model = mlp()
    x, y = data(16 * MICRO)
    opt, sched = sgd_with_halving_lr(model)
    acc = gradaccum.Accumulator(opt, {0: 4, 2: 2}, scheduler=sched)
    for xb, yb in micro_batches(x, y):
        acc.backward(nn.functional.cross_entropy(model(xb), yb))
    ref = mlp()
    ref_opt, ref_sched = sgd_with_halving_lr(ref)
    reference_steps(ref, ref_opt, windows_of(x, y, [4, 4, 4, 4]), scheduler=ref_sched)
    with pytest.raises(AssertionError):
        assert_params_close(model, ref, torch.float64)


def test_callable_schedule_changing_mid_window_waits_for_the_boundary():
    model = mlp()
    ref = clone_model(model)
    x, y = data(8 * MICRO)
    wanted = {"n": 4}
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), lambda k: wanted["n"])
    batches = micro_batches(x, y)
    assert not acc.backward(nn.functional.cross_entropy(model(batches[0][0]), batches[0][1]))
    wanted["n"] = 2  # the window holds 1 of 4 micro-batches: it stays a window of 4
    stepped = [acc.backward(nn.functional.cross_entropy(model(xb), yb)) for xb, yb in batches[1:]]
    assert stepped == [False, False, True, False, True, False, True]
    assert acc.optimizer_steps == 3
    reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), windows_of(x, y, [4, 2, 2]))
    assert_params_close(model, ref, torch.float64)


def test_epoch_schedule_changes_at_the_first_boundary_of_the_epoch():
    # A window carried over the end of epoch 0 keeps its N; the first window of epoch 1 takes the new N.
    model = mlp()
    ref = clone_model(model)
    x, y = data(10 * MICRO)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1),
                                Schedule({0: 4, 1: 2}, by="epoch"))
    batches = micro_batches(x, y)
    for xb, yb in batches[:6]:  # epoch 0: one window and half of the next
        acc.backward(nn.functional.cross_entropy(model(xb), yb))
    acc.set_epoch(1)
    assert (acc.micro_step, acc.steps) == (2, 4)
    stepped = [acc.backward(nn.functional.cross_entropy(model(xb), yb)) for xb, yb in batches[6:]]
    assert stepped == [False, True, False, True]
    reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), windows_of(x, y, [4, 4, 2]))
    assert_params_close(model, ref, torch.float64)


def test_set_epoch_on_an_empty_window_takes_the_new_size_at_once():
    model = mlp()
    ref = clone_model(model)
    x, y = data(12 * MICRO)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1),
                                Schedule({0: 4, 1: 2}, by="epoch"))
    batches = micro_batches(x, y)
    for epoch, part in enumerate((batches[:8], batches[8:])):
        acc.set_epoch(epoch)
        assert acc.steps == (4 if epoch == 0 else 2)
        for xb, yb in part:
            acc.backward(nn.functional.cross_entropy(model(xb), yb))
    assert acc.optimizer_steps == 4 and acc.epoch == 1
    reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), windows_of(x, y, [4, 4, 2, 2]))
    assert_params_close(model, ref, torch.float64)


def build(model, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    return opt, sched, gradaccum.Accumulator(opt, steps, scheduler=sched)


def feed(model, acc, batches):
    for xb, yb in batches:
        acc.backward(nn.functional.cross_entropy(model(xb), yb))


@pytest.mark.parametrize("cut", [7, 8, 9], ids=["before-change", "at-change", "after-change"])
def test_resume_around_a_schedule_change_is_bit_exact(cut):
    # {0: 4, 2: 2}: windows end after micro-batches 4, 8 (the change), 10, 12.
    x, y = data(12 * MICRO)
    batches = micro_batches(x, y)
    straight = mlp()
    _, sched, acc = build(straight, {0: 4, 2: 2})
    feed(straight, acc, batches)
    assert acc.optimizer_steps == 4 and sched.last_epoch == 4

    first = mlp()
    opt1, sched1, acc1 = build(first, {0: 4, 2: 2})
    feed(first, acc1, batches[:cut])
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict(), "sched": sched1.state_dict(),
                "acc": acc1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    resumed = mlp(seed=123)
    opt2, sched2, acc2 = build(resumed, {0: 4, 2: 2})
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    acc2.load_state_dict(saved["acc"])
    assert (acc2.steps, acc2.micro_step) == (acc1.steps, acc1.micro_step)
    feed(resumed, acc2, batches[cut:])
    assert (acc2.optimizer_steps, sched2.last_epoch) == (4, 4)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_from_another_schedule_is_refused():
    model = mlp()
    _, _, acc = build(model, {0: 4, 2: 2})
    _, _, other = build(mlp(), {0: 4, 3: 2})
    with pytest.raises(ValueError, match="steps"):
        acc.load_state_dict(other.state_dict())


def test_epoch_schedule_resumes_its_epoch():
    model = mlp()
    _, _, acc = build(model, Schedule({0: 4, 1: 2}, by="epoch"))
    acc.set_epoch(1)
    state = acc.state_dict()
    _, _, acc2 = build(mlp(), Schedule({0: 4, 1: 2}, by="epoch"))
    acc2.load_state_dict(state)
    assert (acc2.epoch, acc2.steps) == (1, 2)


def test_a_bad_schedule_value_at_a_boundary_does_not_apply_the_window_twice():
    model = nn.Linear(3, 1).double()
    wanted = {"n": 2}
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), lambda k: wanted["n"])
    x = torch.randn(8, 3, dtype=torch.float64)
    acc.backward(model(x[:2]).pow(2).mean())
    wanted["n"] = 0
    with pytest.raises(ValueError, match=r"steps\(1\)"):
        acc.backward(model(x[2:4]).pow(2).mean())  # steps, then reads N for the next window
    assert (acc.optimizer_steps, acc.micro_step) == (1, 0)
    wanted["n"] = 3
    assert acc.backward(model(x[4:6]).pow(2).mean()) is False  # a new window, not the old one again
    assert acc.optimizer_steps == 1


def test_a_skipped_window_does_not_advance_the_schedule():
    # The count is optimizer steps taken, like the LR scheduler's: both stay in step.
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = gradaccum.Accumulator(opt, {0: 2, 1: 1}, scheduler=sched,
                                scaler=torch.amp.GradScaler("cpu"))
    x = torch.randn(6, 3)
    acc.backward(model(x[:2]).sum() * float("inf"))
    assert acc.backward(model(x[2:4]).pow(2).mean()) is False  # non-finite: skipped
    assert (acc.skipped_windows, acc.optimizer_steps, sched.last_epoch, acc.steps) == (1, 0, 0, 2)
    acc.backward(model(x[:2]).pow(2).mean())
    assert acc.backward(model(x[2:4]).pow(2).mean()) is True
    assert (acc.optimizer_steps, sched.last_epoch, acc.steps) == (1, 1, 1)
