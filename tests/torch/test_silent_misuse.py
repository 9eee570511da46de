"""Loops that trained silently wrong (issue 41, item 3), each against its full-batch reference or
refused naming the fix; and their negative twins, which train exactly: parameter groups added
between windows, an optimizer step inside a ``micro_batch()`` block, learning rates changed
inside a window, and states no ``state_dict()`` writes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradaccum
from tests.reference import data, mlp

MICRO = 4


def batches(n_windows, steps, seed=1):
    x, y = data(n_windows * steps * MICRO, seed=seed)
    return list(zip(x.split(MICRO), y.split(MICRO), strict=True))


def loss_of(model, xb, yb):
    return nn.functional.cross_entropy(model(xb), yb)


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=name)


# ---------------------------------------------------------------- progressive unfreezing
def unfreezing_run(model, steps, clip_norm, *, use_acc, save_at=None, stop_at=None, unfreeze_after=2,
                   windows=5):
    """Train the head first; after ``unfreeze_after`` windows unfreeze the first layer and add it
    as a parameter group of its own (another lr). With ``use_acc``: through an Accumulator of
    ``steps``, else one full-batch step per window. ``save_at``: (window, micro-batch) where the
    accumulator's state is saved and the run resumed into a new optimizer and accumulator;
    ``stop_at``: where the run stops (returning the accumulator there)."""
    first, head = model[0], model[2]
    first.requires_grad_(False)
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    acc = gradaccum.Accumulator(opt, steps, clip_norm=clip_norm) if use_acc else None
    data_ = batches(windows, steps)
    for w in range(windows):
        if w == unfreeze_after:
            first.requires_grad_(True)
            opt.add_param_group({"params": first.parameters(), "lr": 0.05})
        window = data_[w * steps:(w + 1) * steps]
        if not use_acc:
            opt.zero_grad(set_to_none=True)
            x, y = torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window])
            loss_of(model, x, y).backward()
            nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip_norm)
            opt.step()
            continue
        for k, (xb, yb) in enumerate(window):
            if stop_at == (w, k):
                return model, acc
            if save_at == (w, k):
                state, opt_state = acc.state_dict(), opt.state_dict()
                del acc
                opt = torch.optim.SGD([{"params": head.parameters()}, {"params": first.parameters()}],
                                      lr=0.1, momentum=0.9)
                opt.load_state_dict(opt_state)
                acc = gradaccum.Accumulator(opt, steps, clip_norm=clip_norm)
                acc.load_state_dict(state)
            assert acc.backward(loss_of(model, xb, yb)) == (k == steps - 1)
    return model, acc


@pytest.mark.parametrize("steps", [1, 4])
def test_a_group_added_between_windows_is_normalized_and_clipped_like_the_full_batch(steps):
    ref, _ = unfreezing_run(mlp(), steps, 0.3, use_acc=False)
    got, _ = unfreezing_run(mlp(), steps, 0.3, use_acc=True)
    assert not torch.equal(ref[0].weight, mlp()[0].weight)  # the added group trained
    assert_same(got, ref)


def test_a_group_added_between_windows_is_saved_and_resumes_bitwise():
    straight, _ = unfreezing_run(mlp(), 4, 0.3, use_acc=True)
    resumed, _ = unfreezing_run(mlp(), 4, 0.3, use_acc=True, save_at=(3, 2))
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_state_saved_after_a_group_was_added_loads_where_the_group_is_added_again():
    """The resume of progressive unfreezing: the optimizer and accumulator built as at the start,
    the group added again (the run is past the unfreezing), then the state loaded."""
    straight, _ = unfreezing_run(mlp(), 4, 0.3, use_acc=True)
    first, acc = unfreezing_run(mlp(), 4, 0.3, use_acc=True, stop_at=(3, 2))  # the group added at 2
    state, opt_state = acc.state_dict(), acc.optimizer.state_dict()
    del acc
    first.zero_grad(set_to_none=True)  # as in a new process: the gradients come from the state
    opt = torch.optim.SGD(first[2].parameters(), lr=0.1, momentum=0.9)
    acc = gradaccum.Accumulator(opt, 4, clip_norm=0.3)
    opt.add_param_group({"params": first[0].parameters(), "lr": 0.05})
    opt.load_state_dict(opt_state)
    acc.load_state_dict(state)
    for xb, yb in batches(5, 4)[3 * 4 + 2:]:
        acc.backward(loss_of(first, xb, yb))
    for p, q in zip(straight.parameters(), first.parameters(), strict=True):
        assert torch.equal(p, q)
    assert_same(first, unfreezing_run(mlp(), 4, 0.3, use_acc=False)[0])


def test_a_group_added_between_windows_is_guarded():
    model = mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    acc = gradaccum.Accumulator(opt, 3)
    for xb, yb in batches(1, 3):
        acc.backward(loss_of(model, xb, yb))
    model[0].requires_grad_(True)
    opt.add_param_group({"params": model[0].parameters()})
    (xb, yb), (xb2, yb2), _ = batches(1, 3, seed=2)
    acc.backward(loss_of(model, xb, yb))
    acc.backward(loss_of(model, xb2, yb2))
    model[0].weight.grad.mul_(0.5)  # per-micro-batch clipping of the new group only
    with pytest.raises(RuntimeError, match=r"changed|edited"):
        acc.backward(loss_of(model, xb, yb))


def test_a_group_added_inside_a_window_is_refused_at_its_boundary():
    model = mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    acc = gradaccum.Accumulator(opt, 2, clip_norm=0.3)
    (xb, yb), (xb2, yb2) = batches(1, 2)
    acc.backward(loss_of(model, xb, yb))
    model[0].requires_grad_(True)
    opt.add_param_group({"params": model[0].parameters()})
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"add_param_group.*between windows"):
        acc.backward(loss_of(model, xb2, yb2))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())
    acc.backward(loss_of(model, xb, yb))  # the next window takes the group in
    assert acc.backward(loss_of(model, xb2, yb2))


# ---------------------------------------------------------------- an optimizer step in a block
@pytest.mark.parametrize("steps", [1, 3])
def test_an_optimizer_step_inside_a_windows_first_block_is_refused(steps):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(opt, steps)
    xb, yb = batches(1, 1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    refused = r"optimizer.step\(\) was called inside an acc.micro_batch"
    with pytest.raises(RuntimeError, match=refused), acc.micro_batch() as mb:
        mb.backward(loss_of(model, xb, yb))
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    acc.discard()
    with acc.micro_batch() as mb:  # the twin: the step is the accumulator's
        mb.backward(loss_of(model, xb, yb))
    assert mb.stepped == (steps == 1) and acc.optimizer_steps == (steps == 1)
    if steps == 1:
        opt.step()  # after the boundary, outside a block: every gradient None, nothing changes


# ---------------------------------------------------------------- learning rates in a window
def sequential(opt):
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3)
    decay = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[3]), warmup


@pytest.mark.parametrize("per", ["micro_batch", "window"])
def test_a_sequential_lrs_child_stepped_directly_is_refused(per):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched, child = sequential(opt)
    acc = gradaccum.Accumulator(opt, 4, scheduler=sched)
    with pytest.raises(RuntimeError, match=r"learning rate|child"):
        for xb, yb in batches(3, 4):
            stepped = acc.backward(loss_of(model, xb, yb))
            if per == "micro_batch" or stepped:
                child.step()


def test_a_second_scheduler_stepped_every_micro_batch_is_refused_at_the_boundary():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(opt, 4, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    other = torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)
    data_ = batches(1, 4)
    for xb, yb in data_[:3]:
        acc.backward(loss_of(model, xb, yb))
        other.step()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"learning rate.*changed inside the window"):
        acc.backward(loss_of(model, *data_[3]))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert acc.micro_step == 0  # the window is dropped


def test_learning_rates_changed_between_windows_are_the_users_own():
    """A second scheduler chained once per window, ReduceLROnPlateau as the docs say, and a hand
    edit of ``lr``: each at a boundary, each exactly the full-batch loop's."""

    def run(use_acc):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
        chained = torch.optim.lr_scheduler.ExponentialLR(opt, 0.95)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        acc = gradaccum.Accumulator(opt, 4, scheduler=sched) if use_acc else None
        data_ = batches(5, 4)
        for w in range(5):
            window = data_[w * 4:(w + 1) * 4]
            if use_acc:
                for xb, yb in window:
                    stepped = acc.backward(loss_of(model, xb, yb))
                assert stepped
                loss = float(acc.window_loss)
            else:
                opt.zero_grad(set_to_none=True)
                x, y = torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window])
                out = loss_of(model, x, y)
                out.backward()
                opt.step()
                sched.step()
                loss = float(out.detach())
            chained.step()
            plateau.step(loss + w)  # worsening: it reduces
            if w == 2:
                opt.param_groups[0]["lr"] = 0.07
        return model, opt.param_groups[0]["lr"]

    (got, lr_got), (ref, lr_ref) = run(True), run(False)
    assert lr_got == pytest.approx(lr_ref, rel=1e-12) and lr_ref < 0.07
    assert_same(got, ref)


# ---------------------------------------------------------------- states no state_dict writes
def saved_state(steps=4, fed=1, **options):
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps, **options)
    for xb, yb in batches(1, steps)[:fed]:
        acc.backward(loss_of(model, xb, yb), n_items=torch.tensor(len(xb)))
    return model, acc, acc.state_dict()


@pytest.mark.parametrize("opened_at", ["deleted", None])
def test_a_window_size_no_schedule_or_resize_gave_is_refused(opened_at):
    model, acc, state = saved_state()
    state["window"]["size"] = 2**40
    if opened_at == "deleted":
        del state["window"]["opened_at"]
    else:
        state["window"]["opened_at"] = None
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"state\['window'\]\['size'\]"):
        acc.load_state_dict(state)
    assert (acc.micro_step, acc.steps) == (1, 4)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


def test_a_resized_window_still_loads():
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    acc.resize_window(5)
    xb, yb = batches(1, 1)[0]
    acc.backward(loss_of(model, xb, yb))
    state = acc.state_dict()
    acc2 = gradaccum.Accumulator(torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1), 2)
    del acc
    acc2.load_state_dict(state)
    assert (acc2.micro_step, acc2.steps) == (1, 5)


@pytest.mark.parametrize("big", [torch.tensor(2.0**60, dtype=torch.float64), 2**60, 2.0**53 + 2])
def test_an_item_total_beyond_what_a_feed_accepts_is_refused(big):
    model, acc, state = saved_state(fed=1)
    grads = [p.grad.clone() for p in model.parameters()]
    state["window"]["items"] = big  # the window's update would shrink to about 0
    with pytest.raises(ValueError, match=r"state\['window'\]\['items'\] is .*beyond 2\*\*53"):
        acc.load_state_dict(state)
    assert acc.micro_step == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    state["window"]["items"] = torch.tensor(2.0**53, dtype=torch.float64)  # the largest a feed takes
    acc.load_state_dict(state)


def test_a_state_from_0_3_0_carried_into_a_later_epoch_still_loads():
    """Without ``opened_at`` (0.3.0): the size an epoch schedule gave at the saved epoch or an
    earlier one (a window carried over by set_epoch) loads; another is refused."""
    steps = gradaccum.Schedule({0: 3, 1: 2}, by="epoch")
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps)
    xb, yb = batches(1, 1)[0]
    acc.backward(loss_of(model, xb, yb))
    acc.set_epoch(1)
    state = acc.state_dict()
    del state["window"]["opened_at"]
    state["window"].pop("resized", None)
    acc.load_state_dict(state)
    assert (acc.micro_step, acc.steps) == (1, 3)
    state["window"]["size"] = 5
    with pytest.raises(ValueError, match=r"\['size'\] is 5, but steps=.* gives 2 at epoch 1"):
        acc.load_state_dict(state)


# ---------------------------------------------------------------- what the guards cannot see
def test_an_edit_through_grad_data_goes_unseen_as_the_guide_says():
    """docs/GUIDE.md, "What the guards cannot see": ``.data`` has a version counter of its own.
    Should a cheap check ever see it, this test fails and the page changes with it."""
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    data_ = batches(1, 3)
    acc.backward(loss_of(model, *data_[0]))
    acc.backward(loss_of(model, *data_[1]))
    model[0].weight.grad.data.mul_(0.5)
    assert acc.backward(loss_of(model, *data_[2]))  # not refused


def _bf16_unfreezing(adopt):
    """bf16 parameters summed in float32 buffers (``accum_dtype``); the first layer joins after one
    window. ``adopt``: the same accumulator takes it in; else a new one is built there."""
    model = mlp(torch.bfloat16)
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    acc = gradaccum.Accumulator(opt, 2, clip_norm=0.3, accum_dtype=torch.float32)
    for w, window in enumerate((batches(1, 2), batches(1, 2, seed=2), batches(1, 2, seed=3))):
        if w == 1:
            model[0].requires_grad_(True)
            opt.add_param_group({"params": model[0].parameters(), "lr": 0.05})
            if not adopt:
                acc = gradaccum.Accumulator(opt, 2, clip_norm=0.3, accum_dtype=torch.float32)
        for xb, yb in window:
            acc.backward(loss_of(model, xb.bfloat16(), yb))
    return model, acc


def test_a_group_added_between_windows_gets_its_wide_buffers_as_a_new_accumulator_would():
    (adopted, acc), (rebuilt, _) = _bf16_unfreezing(True), _bf16_unfreezing(False)
    assert acc.state_dict()["accum"] is not None and acc.optimizer_steps == 3
    assert not torch.equal(adopted[0].weight, mlp(torch.bfloat16)[0].weight)
    for p, q in zip(adopted.parameters(), rebuilt.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_group_added_between_windows_reaches_backward_cached():
    """Both towers frozen, the temperature trained; then the text tower joins: backward_cached's
    check of the trainable parameters sees it (an encode that detaches is refused, naming them)."""
    from tests.contrastive import Towers, clip_loss, pairs

    model = Towers()
    model.image.requires_grad_(False)
    model.text.requires_grad_(False)
    opt = torch.optim.SGD([model.logit_scale], lr=0.1)
    acc = gradaccum.Accumulator(opt, 1, model=model)
    chunks = list(zip(*(z.split(4) for z in pairs(8)), strict=True))
    loss = lambda i, t: clip_loss(i, t, model.logit_scale)  # noqa: E731
    detached = lambda c: tuple(z.detach() for z in model(*c))  # noqa: E731
    assert acc.backward_cached(detached, loss, chunks)  # nothing trainable upstream: as a full batch
    model.text.requires_grad_(True)
    opt.add_param_group({"params": model.text.parameters()})
    with pytest.raises(ValueError, match=r"encode reads 4 trainable parameter\(s\)"):
        acc.backward_cached(detached, loss, chunks)
