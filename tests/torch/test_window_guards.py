"""The once-per-window guards: a scheduler stepped outside the accumulator, stale gradients at a
window's first micro-batch, and every parameter's gradient changed outside it before the window's
last (torch/_guards.py, torch/_window_grads.py). Each mistake raises, naming the fix, before the
micro-batch's backward (or drops the window at the boundary); each flow the library runs itself
stays silent and exact."""

from __future__ import annotations

import copy
import gc
import re
import threading
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradaccum
from tests.contrastive import Towers, clip_loss, pairs
from tests.reference import assert_params_close, clone_model, data, mlp, reference_steps, snapshot

LR = 0.1


class Net(nn.Module):
    """Named layers (so messages can name a parameter), and a head only some micro-batches use."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 8).double()
        self.head = nn.Linear(8, 3).double()
        self.extra = nn.Linear(8, 3).double()

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(h) + (self.extra(h) if use_extra else 0)


def ce(model, x, y, **kw):
    return nn.functional.cross_entropy(model(x, **kw) if kw else model(x), y)


def grads_of(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def same_grads(model, saved):
    return all((p.grad is None and g is None)
               or (p.grad is not None and g is not None and torch.equal(p.grad, g))
               for p, g in zip(model.parameters(), saved, strict=True))


# -- 2. the scheduler, stepped once per window ----------------------------------------------------

def sched_setup(steps=2):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    return model, opt, sched, gradaccum.Accumulator(opt, steps, scheduler=sched)


def test_your_own_scheduler_step_after_a_window_is_refused_at_the_next_one_before_anything_changes():
    # Silent before: the LR halved twice per window.
    model, opt, sched, acc = sched_setup()
    x, y = data(8)
    for xb, yb in zip(x[:4].split(2), y[:4].split(2), strict=True):
        if acc.backward(ce(model, xb, yb)):
            sched.step()  # the loop's own step, beside scheduler=
    before, lr = snapshot(model), opt.param_groups[0]["lr"]
    with pytest.raises(RuntimeError, match=r"^scheduler\.step\(\) was called outside the accumulator: "
                                           r"the scheduler's last_epoch is 2, its step at the last "
                                           r"boundary left it at 1 \(its learning rate is now 1 "
                                           r"step\(s\) ahead\)\.") as err:
        acc.backward(ce(model, x[4:6], y[4:6]))
    assert "remove your own scheduler.step()" in str(err.value)
    assert "do not pass scheduler=" in str(err.value) and "nothing has changed" in str(err.value)
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert opt.param_groups[0]["lr"] == lr and acc.optimizer_steps == 1
    # Said once: the loop without its own step trains on (before, every window raised again).
    for xb, yb in zip(x[4:].split(2), y[4:].split(2), strict=True):
        acc.backward(ce(model, xb, yb))
    assert acc.optimizer_steps == 2 and sched.last_epoch == 3


def test_a_discarded_window_takes_the_scheduler_as_it_is():
    model, _, sched, acc = sched_setup()
    x, y = data(6)
    acc.backward(ce(model, x[:2], y[:2]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's: "lr_scheduler.step() before optimizer.step()"
        sched.step()
    acc.discard()  # the window and the step of yours dropped together
    for xb, yb in zip(x[2:].split(2), y[2:].split(2), strict=True):
        acc.backward(ce(model, xb, yb))
    assert acc.optimizer_steps == 1 and sched.last_epoch == 2


def test_a_scheduler_stepped_inside_a_window_is_refused_at_its_boundary_and_the_window_dropped():
    model, _, sched, acc = sched_setup()
    x, y = data(8)
    acc.backward(ce(model, x[:2], y[:2]))  # the first window's first micro-batch: count read
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's: "lr_scheduler.step() before optimizer.step()"
        sched.step()  # a per-micro-batch scheduler
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=r"scheduler\.step\(\) was called outside.*this window is dropped"):
        acc.backward(ce(model, x[2:4], y[2:4]))
    assert acc.micro_step == 0 and acc.optimizer_steps == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_the_scheduler_check_stays_quiet_on_a_resume_and_without_a_count():
    # A scheduler's state loaded after the accumulator was built (the usual resume), or loaded
    # beside acc.load_state_dict, moves its count: not a step of yours.
    model, opt, sched, acc = sched_setup()
    x, y = data(16)
    later = copy.deepcopy(sched.state_dict())
    later["last_epoch"] = 7
    sched.load_state_dict(later)
    state = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i, (xb, yb) in enumerate(zip(x.split(2), y.split(2), strict=True)):
            acc.backward(ce(model, xb, yb))
            if i == 4:
                state, sched_state = acc.state_dict(), copy.deepcopy(sched.state_dict())
        sched_state["last_epoch"] += 3
        sched.load_state_dict(sched_state)
        acc.load_state_dict(state)
        acc.backward(ce(model, x[:2], y[:2]))
    assert sched.last_epoch == 7 + 2 + 3 + 1

    class Counterless:  # a scheduler without last_epoch is not checked
        def __init__(self):
            self.optimizer = opt

        def step(self):
            pass

    plain = Counterless()
    acc2 = gradaccum.Accumulator(opt, 1, scheduler=plain)
    del acc
    for xb, yb in zip(x[:6].split(2), y[:6].split(2), strict=True):
        acc2.backward(ce(model, xb, yb))
        plain.step()


# -- 3. stale gradients at a window's first micro-batch --------------------------------------------

def stale_by(how, model, x, y):
    if how == "a backward of your own":
        ce(model, x, y).backward()
    elif how == "a gradient left from evaluation":
        model.eval()
        ce(model, x, y).backward()
        model.train()


@pytest.mark.parametrize("how", ["a backward of your own", "a gradient left from evaluation"])
@pytest.mark.parametrize("feed", ["backward", "micro_batch", "backward_cached"])
def test_a_stale_gradient_is_refused_at_the_first_micro_batch_before_its_backward(how, feed):
    # 2.0x before: the stale gradient was added into the first window silently.
    model = Towers() if feed == "backward_cached" else mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = gradaccum.Accumulator(opt, 2, model=model)
    if feed == "backward_cached":
        images, texts = pairs(8)
        clip_loss(*model(images, texts), model.logit_scale).backward()
    else:
        x, y = data(8)
        stale_by(how, model, x[:4], y[:4])
    held, before = grads_of(model), snapshot(model)
    with pytest.raises(RuntimeError, match=r"^parameter '.*' already holds a nonzero gradient at the first "
                                           r"micro-batch of a window") as err:
        if feed == "backward":
            acc.backward(ce(model, x[4:], y[4:]))
        elif feed == "micro_batch":
            with acc.micro_batch() as mb:
                mb.backward(ce(model, x[4:], y[4:]))
        else:
            acc.backward_cached(lambda c: model(*c), lambda i, t: clip_loss(i, t, model.logit_scale),
                                gradaccum.chunks((images, texts), 4))
    assert "optimizer.zero_grad(set_to_none=True) before the loop" in str(err.value)
    assert acc.micro_step == 0 and same_grads(model, held)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_without_model_the_stale_parameter_is_named_by_its_index():
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR), 2)
    x, y = data(4)
    model[2].bias.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"^the optimizer's parameter 3 \(shape \(3,\)\) already holds"):
        acc.backward(ce(model, x, y))


def test_a_micro_batch_block_that_raised_and_was_not_discarded_is_caught():
    # Its gradients were partly accumulated and the next window's first micro-batch added them in.
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR), 2)
    x, y = data(8)
    with pytest.raises(ZeroDivisionError), acc.micro_batch() as mb:
        mb.backward(ce(model, x[:4], y[:4]))
        raise ZeroDivisionError
    with pytest.raises(RuntimeError, match=r"acc\.discard\(\) after a micro-batch that raised"):
        acc.backward(ce(model, x[4:], y[4:]))
    acc.discard()
    acc.backward(ce(model, x[4:6], y[4:6]))  # goes on after the fix the message names


def test_zero_gradients_and_the_accumulators_own_flows_are_not_stale():
    # zero_grad(set_to_none=False) leaves zeros: no stale value. discard, flush, a boundary and
    # the load of an empty window clear .grad themselves; each next window is exact.
    model = mlp()
    ref = clone_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = gradaccum.Accumulator(opt, 2)
    x, y = data(24)
    b = list(zip(x.split(4), y.split(4), strict=True))
    ce(model, *b[0]).backward()
    opt.zero_grad(set_to_none=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.backward(ce(model, *b[0]))
        acc.discard()
        acc.backward(ce(model, *b[0]))
        assert acc.flush()
        empty = acc.state_dict()
        acc.backward(ce(model, *b[1]))
        acc.backward(ce(model, *b[2]))  # a boundary
        acc.load_state_dict(empty)
        acc.backward(ce(model, *b[3]))
        acc.backward(ce(model, *b[4]))
    ropt = torch.optim.SGD(ref.parameters(), lr=LR)
    reference_steps(ref, ropt, [b[0], (torch.cat([b[1][0], b[2][0]]), torch.cat([b[1][1], b[2][1]])),
                                (torch.cat([b[3][0], b[4][0]]), torch.cat([b[3][1], b[4][1]]))])
    assert_params_close(model, ref, torch.float64)


# -- 4. every parameter's gradient, once per window ------------------------------------------------

def edit(how, model):
    bias = model.head.bias
    if how == "mul_":
        bias.grad.mul_(2)
    elif how == "set to None":
        bias.grad = None
    elif how == "replaced":
        bias.grad = bias.grad * 2
    elif how == "clip_grad_norm_ of the head":
        nn.utils.clip_grad_norm_(model.head.parameters(), 1e-3)


@pytest.mark.parametrize("how, after, name, what, at", [
    ("mul_", 2, "head.bias", "changed in place", 2),  # refused at the next micro-batch
    ("mul_", 3, "head.bias", "changed in place", 3),
    ("set to None", 2, "head.bias", "replaced by another tensor", 3),  # micro-batch 3 made a new one
    ("set to None", 3, "head.bias", "cleared (set to None)", 3),  # refused before the last
    ("replaced", 2, "head.bias", "replaced by another tensor", 3),
    ("clip_grad_norm_ of the head", 2, "head.weight", "changed in place", 2),
])
@pytest.mark.parametrize("end", ["backward", "flush"])
def test_an_unwatched_gradient_edited_mid_window_is_refused_before_the_last_micro_batch(how, after, name,
                                                                                       what, at, end):
    # 1.1e-2 off in 0.2.x: only the probe (body.weight, the first parameter) was watched. An edit
    # in place is refused at the next micro-batch, a cleared or replaced gradient before the last.
    model = Net()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR), 4, model=model)
    x, y = data(16)
    for i, (xb, yb) in enumerate(zip(x[:4 * at].split(4), y[:4 * at].split(4), strict=True)):
        acc.backward(ce(model, xb, yb))
        if i + 1 == after:
            edit(how, model)
    before, held = snapshot(model), grads_of(model)
    want = (rf"^the gradient of parameter '{re.escape(name)}' was {re.escape(what)} outside the "
            rf"accumulator during this window \({at} of 4 micro-batches fed\)")
    nxt = x[4 * at:4 * at + 4], y[4 * at:4 * at + 4]
    with pytest.raises(RuntimeError, match=want) as err:
        if end == "backward":
            acc.backward(ce(model, *nxt))
        else:
            acc.flush()
    assert "acc.discard() this window" in str(err.value)
    assert acc.micro_step == at and same_grads(model, held)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    with pytest.raises(RuntimeError, match=want):  # again, until the window is discarded
        acc.backward(ce(model, *nxt))
    acc.discard()
    for xb, yb in zip(x.split(4), y.split(4), strict=True):
        acc.backward(ce(model, xb, yb))
    assert acc.optimizer_steps == 1


def test_without_model_the_edited_parameter_is_named_by_its_index():
    model = Net()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR), 3)
    x, y = data(12)
    acc.backward(ce(model, x[:4], y[:4]))
    model.head.bias.grad.mul_(2)
    with pytest.raises(RuntimeError, match=r"^the gradient of the optimizer's parameter 3 \(shape \(3,\)\) "
                                           "was changed in place"):
        acc.backward(ce(model, x[4:8], y[4:8]))


def run_window(feed, model, acc, batches, start=0):
    """Feed ``batches`` (from batch ``start`` on), each as ``feed`` says; returns what each call
    returned."""
    out = []
    for i, (xb, yb) in enumerate(batches, start):
        if feed == "backward":
            out.append(acc.backward(ce(model, xb, yb, use_extra=i % 2 == 1)))
        elif feed == "micro_batch":
            with acc.micro_batch() as mb:
                mb.backward(ce(model, xb[:2], yb[:2], use_extra=i == 2) * 0.5)
                mb.backward(ce(model, xb[2:], yb[2:]) * 0.5)
                mb.backward(ce(model, xb, yb, use_extra=True) * 0)  # a pass that adds zeros
            out.append(mb.stepped)
    return out


@pytest.mark.parametrize("feed", ["backward", "micro_batch"])
@pytest.mark.parametrize("options", [{}, {"scaler": True}, {"clip_norm": 0.5}])
def test_the_accumulators_own_passes_are_not_taken_for_an_edit(feed, options):
    # Parameters unused in some micro-batches (extra), blocks of several backward calls, a
    # GradScaler, clipping, a resume mid-window: silent, and exact against the dense reference.
    model = Net()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if options.get("scaler") else None
    acc = gradaccum.Accumulator(opt, 4, model=model, scaler=scaler, clip_norm=options.get("clip_norm"))
    x, y = data(32)
    batches = list(zip(x.split(4), y.split(4), strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_window(feed, model, acc, batches[:3])
        _ = [p.grad.norm() for p in model.parameters() if p.grad is not None]  # reading is fine
        state = acc.state_dict()
        del acc
        acc = gradaccum.Accumulator(opt, 4, model=model, scaler=scaler, clip_norm=options.get("clip_norm"))
        acc.load_state_dict(state)
        out = run_window(feed, model, acc, batches[3:], 3)
    assert out == [True, False, False, False, True]
    topt = torch.optim.SGD(twin.parameters(), lr=LR)
    tacc = gradaccum.Accumulator(topt, 4, model=twin, clip_norm=options.get("clip_norm"))
    run_window(feed, twin, tacc, batches)  # the same run without the resume (and scaler)
    assert_params_close(model, twin, torch.float64)


def test_backward_cached_windows_with_a_learnable_temperature_are_not_taken_for_an_edit():
    model = Towers()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR), 3, model=model)
    loss = lambda i, t: clip_loss(i, t, model.logit_scale)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(6):
            acc.backward_cached(lambda c: model(*c), loss, gradaccum.chunks(pairs(12, seed=seed), 5))
    assert acc.optimizer_steps == 2
    acc.backward_cached(lambda c: model(*c), loss, gradaccum.chunks(pairs(12, seed=7), 5))
    model.text[2].bias.grad.mul_(3)  # not the first parameter (logit_scale)
    with pytest.raises(RuntimeError, match=r"gradient of parameter 'text\.2\.bias' was changed in place"):
        acc.backward_cached(lambda c: model(*c), loss, gradaccum.chunks(pairs(12, seed=8), 5))


class Reentrant(nn.Module):
    """A layer applied twice, each time in a reentrant checkpoint: its parameters take two
    additions per backward pass (a nested backward per segment)."""

    def __init__(self, reentrant: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(6, 6).double()
        self.out = nn.Linear(6, 3).double()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        def seg(t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.shared(t))
        if self.reentrant:
            x = x.requires_grad_()  # a reentrant checkpoint needs an input that requires grad
            h = checkpoint(seg, checkpoint(seg, x, use_reentrant=True), use_reentrant=True)
        else:
            h = seg(seg(x))
        return self.out(h)


@pytest.mark.parametrize("feed", ["backward", "micro_batch"])
def test_reentrant_checkpointing_of_a_shared_layer_is_not_taken_for_an_edit(feed):
    # Refused in the first window before ("changed in place"): 0.3.0 ran it, exact.
    model, twin = Reentrant(), Reentrant(reentrant=False)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR), 4, model=model)
    tacc = gradaccum.Accumulator(torch.optim.SGD(twin.parameters(), lr=LR), 4, model=twin)
    x, y = data(48)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for m, a in ((model, acc), (twin, tacc)):
            run_window(feed, m, a, zip(x.split(4), y.split(4), strict=True))
    assert acc.optimizer_steps == 3
    assert_params_close(model, twin, torch.float64)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # counted in each
    # window's first micro-batch only
    assert all(not p._post_accumulate_grad_hooks for p in twin.parameters())


class StackedExperts(nn.Module):
    """An MoE layer written as many are: the experts' weights combined in the forward with
    ``torch.stack`` (or ``torch.cat``), so their gradients are views of one buffer sharing one
    version counter; a router picks one expert per row."""

    def __init__(self, combine: str = "stack", experts: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(6, experts).double()
        self.experts = nn.ModuleList(nn.Linear(6, 3).double() for _ in range(experts))
        self.combine = combine

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        if self.combine == "stack":
            w = torch.stack([e.weight for e in self.experts])
            b = torch.stack([e.bias for e in self.experts])
        else:
            w = torch.cat([e.weight for e in self.experts]).view(len(self.experts), 3, 6)
            b = torch.cat([e.bias for e in self.experts]).view(len(self.experts), 3)
        pick = self.router(x).argmax(-1)
        gate = torch.softmax(self.router(x), -1).gather(1, pick[:, None])
        return gate * (torch.einsum("noi,ni->no", w[pick], x) + b[pick])


class VaryingDepth(nn.Module):
    """A shared block under reentrant checkpointing, applied as often as the micro-batch says."""

    def __init__(self, reentrant: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Linear(6, 6).double()
        self.out = nn.Linear(6, 3).double()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor, depth: int = 1) -> torch.Tensor:
        for _ in range(depth):
            x = (checkpoint(self.block, x.requires_grad_(), use_reentrant=True) if self.reentrant
                 else self.block(x)).tanh()
        return self.out(x)


@pytest.mark.parametrize("combine", ["stack", "cat"])
@pytest.mark.parametrize("steps", [3, 4])
def test_experts_combined_with_stack_or_cat_train_exactly(combine, steps):
    # Refused at micro-batch 3 on b6bbc83 ("the gradient of 'experts.0.bias' was changed in
    # place"): one addition into any expert advances the counter all of them share.
    model = StackedExperts(combine)
    ref = clone_model(model)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), steps,
                                model=model, clip_norm=0.5)
    x, y = data(8 * steps * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for xb, yb in zip(x.split(8), y.split(8), strict=True):
            acc.backward(ce(model, xb, yb))
    assert acc.optimizer_steps == 3
    ropt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    reference_steps(ref, ropt, list(zip(x.split(8 * steps), y.split(8 * steps), strict=True)), clip_norm=0.5)
    assert_params_close(model, ref, torch.float64)
    # and an edit of one expert's gradient is still refused, naming it
    acc.backward(ce(model, x[:8], y[:8]))
    model.experts[1].weight.grad.mul_(2)
    with pytest.raises(RuntimeError, match=r"^the gradient of parameter 'experts\.0\.weight' was changed in "
                                           r"place \(or one of parameter 'experts\.1\.weight', .*views of"):
        acc.backward(ce(model, x[8:16], y[8:16]))


@pytest.mark.parametrize("feed", ["backward", "micro_batch"])
def test_a_reentrant_depth_that_varies_between_micro_batches_trains_exactly(feed):
    # Refused at micro-batch 4 on b6bbc83: the additions per pass were counted in the run's first
    # micro-batch only (depth 1 there, 2 later).
    model, twin = VaryingDepth(), VaryingDepth(reentrant=False)
    depths = [1, 1, 2, 3, 2, 1, 1, 3]
    x, y = data(4 * len(depths))
    accs = [gradaccum.Accumulator(torch.optim.SGD(m.parameters(), lr=LR), 4, model=m) for m in (model, twin)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for m, acc in zip((model, twin), accs, strict=True):
            for d, xb, yb in zip(depths, x.split(4), y.split(4), strict=True):
                if feed == "backward":
                    acc.backward(ce(m, xb, yb, depth=d))
                else:
                    with acc.micro_batch() as mb:
                        mb.backward(ce(m, xb[:2], yb[:2], depth=d) / 2)
                        mb.backward(ce(m, xb[2:], yb[2:], depth=4 - d) / 2)
    assert accs[0].optimizer_steps == 2
    assert_params_close(model, twin, torch.float64)


@pytest.mark.parametrize("steps", [1, 3])
def test_a_gan_whose_generator_step_reaches_the_discriminator_names_that_backward(steps):
    # b6bbc83 said "zero_grad(), clipping or scaling gradients yourself" (steps=3) or "your own
    # loss.backward() before the loop" (steps=1): G's backward through a D that still requires
    # grad adds into D's open window.
    torch.manual_seed(0)
    g_net, d_net = nn.Linear(4, 6).double(), nn.Linear(6, 1).double()
    acc_d = gradaccum.Accumulator(torch.optim.SGD(d_net.parameters(), lr=LR), steps, model=d_net)
    acc_g = gradaccum.Accumulator(torch.optim.SGD(g_net.parameters(), lr=LR), steps, model=g_net)
    real, z = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    bce = nn.functional.binary_cross_entropy_with_logits
    fake = g_net(z)
    acc_d.backward(bce(d_net(real), torch.ones(4, 1, dtype=torch.float64))
                   + bce(d_net(fake.detach()), torch.zeros(4, 1, dtype=torch.float64)))
    acc_g.backward(bce(d_net(fake), torch.ones(4, 1, dtype=torch.float64)))  # D not frozen
    with pytest.raises(RuntimeError, match=r"Another accumulator fed a micro-batch since this one's "
                                           r"last.*a GAN's generator step through a discriminator"):
        acc_d.backward(bce(d_net(real), torch.ones(4, 1, dtype=torch.float64)))
    # frozen during G's step, it trains
    acc_d.discard()
    acc_g.discard()
    done = acc_d.optimizer_steps, acc_g.optimizer_steps  # steps=1: the first windows stepped
    for _ in range(2 * steps):
        fake = g_net(z)
        acc_d.backward(bce(d_net(real), torch.ones(4, 1, dtype=torch.float64))
                       + bce(d_net(fake.detach()), torch.zeros(4, 1, dtype=torch.float64)))
        d_net.requires_grad_(False)
        acc_g.backward(bce(d_net(fake), torch.ones(4, 1, dtype=torch.float64)))
        d_net.requires_grad_(True)
    assert (acc_d.optimizer_steps - done[0], acc_g.optimizer_steps - done[1]) == (2, 2)


def test_an_edit_of_a_gradient_added_into_twice_per_pass_is_still_refused():
    model = Reentrant()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR), 4, model=model)
    x, y = data(16)
    for xb, yb in zip(x[:8].split(4), y[:8].split(4), strict=True):
        acc.backward(ce(model, xb, yb))
    model.shared.bias.grad.mul_(2)
    with pytest.raises(RuntimeError, match=r"^the gradient of parameter 'shared\.bias' was changed in place"):
        acc.backward(ce(model, x[8:12], y[8:12]))


@pytest.mark.parametrize("feed", ["backward", "micro_batch", "raised, then discard", "raised, then dropped"])
def test_no_hook_or_wrapper_is_ever_left_on_a_parameter(feed):
    # b6bbc83 counted additions with register_post_accumulate_grad_hook in the first micro-batch:
    # removing the handles left torch's per-parameter wrapper (``_post_accumulate_grad_hooks`` an
    # empty dict, not None), entered on every later backward for the life of the model.
    model = Net()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR), 2, model=model)
    x, y = data(8)
    if feed.startswith("raised"):
        out = model(x)
        out.register_hook(lambda _: (_ for _ in ()).throw(RuntimeError("boom")))  # after head's grads
        with pytest.raises(RuntimeError, match="boom"):
            acc.backward(nn.functional.cross_entropy(out, y))
        if feed.endswith("discard"):
            acc.discard()
        else:
            del acc
            gc.collect()
            model.zero_grad(set_to_none=True)
    else:
        run_window(feed, model, acc, zip(x.split(2), y.split(2), strict=True))
    assert all(p._post_accumulate_grad_hooks is None for p in model.parameters())
    assert all(p._backward_hooks is None for p in model.parameters())


def test_accum_dtype_buffers_are_not_checked_and_not_taken_for_an_edit():
    model = nn.Linear(6, 3).to(torch.bfloat16)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR), 4, accum_dtype=torch.float32)
    x = torch.randn(16, 6, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for xb in x.split(4):
            acc.backward(model(xb).float().pow(2).mean())
    assert acc.optimizer_steps == 1


# -- 11. one caller at a time ------------------------------------------------------------------

class Held(torch.autograd.Function):
    """Passes a loss through; its backward waits until ``release`` is set (another thread's turn)."""

    entered = threading.Event()
    release = threading.Event()

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        Held.entered.set()
        assert Held.release.wait(30)
        return g


@pytest.mark.parametrize("second", ["backward", "micro_batch", "backward_cached", "flush", "discard",
                                    "state_dict", "load_state_dict", "set_epoch", "resize_window"])
def test_a_call_from_another_thread_while_one_runs_is_refused_and_counts_nothing(second):
    # One accumulator fed from 2 threads counted 82 or 83 micro-batches of 80, silently; discard(),
    # state_dict() and the others were not refused at all (a discard() there cleared the window
    # under the running backward: the micro-batch was counted without its gradient).
    model = Towers()
    twin = copy.deepcopy(model)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR), 4, model=model)
    images, texts = pairs(8)
    state = acc.state_dict()
    Held.entered.clear()
    Held.release.clear()
    errors = []

    def first():
        acc.backward(Held.apply(clip_loss(*model(images, texts), model.logit_scale)))

    thread = threading.Thread(target=first)
    thread.start()
    assert Held.entered.wait(30)  # the first call is inside its backward
    try:
        if second == "backward":
            acc.backward(clip_loss(*model(images, texts), model.logit_scale))
        elif second == "micro_batch":
            with acc.micro_batch() as mb:
                mb.backward(clip_loss(*model(images, texts), model.logit_scale))
        elif second == "backward_cached":
            acc.backward_cached(lambda c: model(*c), lambda i, t: clip_loss(i, t, model.logit_scale),
                                gradaccum.chunks((images, texts), 4))
        elif second == "load_state_dict":
            acc.load_state_dict(state)
        else:
            getattr(acc, second)(*{"set_epoch": (1,), "resize_window": (3,)}.get(second, ()))
    except RuntimeError as e:
        errors.append(str(e))
    finally:
        Held.release.set()
        thread.join(30)
    assert len(errors) == 1 and errors[0].startswith(f"acc.{second}() was called while another call of "
                                                     "this accumulator is still running")
    assert "an Accumulator is not thread-safe: feed it from one thread" in errors[0]
    assert acc.micro_step == 1  # the first call's micro-batch, once
    clip_loss(*twin(images, texts), twin.logit_scale).backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad / 4, atol=1e-12, rtol=0)


def test_a_feeding_call_inside_its_own_micro_batch_block_is_refused():
    # It committed a micro-batch the block's own commit then overwrote (silently before).
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR), 4)
    x, y = data(8)
    with acc.micro_batch() as mb:
        mb.backward(ce(model, x[:4], y[:4]))
        with pytest.raises(RuntimeError, match=r"acc\.backward\(\) was called .* inside its own "
                                               r"acc\.micro_batch\(\) block"):
            acc.backward(ce(model, x[4:], y[4:]))
    assert acc.micro_step == 1
    acc.backward(ce(model, x[4:], y[4:]))  # and the next call goes through
    assert acc.micro_step == 2


@pytest.mark.parametrize("call", ["discard", "state_dict", "load_state_dict", "set_epoch", "resize_window",
                                  "flush"])
def test_the_window_is_not_changed_from_inside_its_own_micro_batch_block(call):
    # Before: discard() there cleared the gradients and the block then committed a micro-batch
    # into the emptied window; state_dict() saved a micro-batch half fed.
    model = Net()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR), 2, model=model)
    x, y = data(8)
    state = acc.state_dict()
    acc.backward(ce(model, x[:2], y[:2]))
    args = {"load_state_dict": (state,), "set_epoch": (1,), "resize_window": (3,)}.get(call, ())
    with acc.micro_batch() as mb:
        mb.backward(ce(model, x[2:4], y[2:4]) * 0.5)
        held = grads_of(model)
        with pytest.raises(RuntimeError, match=rf"^acc\.{call}\(\) was called inside an acc\.micro_batch\(\) "
                                               r"block.*nothing has changed$"):
            getattr(acc, call)(*args)
        assert same_grads(model, held) and acc.micro_step == 1 and acc.epoch == 0
        mb.backward(ce(model, x[2:4], y[2:4]) * 0.5)
    assert mb.stepped and acc.optimizer_steps == 1
    getattr(acc, call)(*args)  # outside the block: as before


def test_a_refused_boundary_after_a_failed_one_counts_no_step():
    # A boundary whose optimizer stepped before a post-hook raised is counted; the next refused
    # boundary (the scheduler moved) stepped nothing and must count nothing.
    model, opt, sched, acc = sched_setup()
    x, y = data(8)
    handle = opt.register_step_post_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("hook failed")))
    acc.backward(ce(model, x[:2], y[:2]))
    with pytest.raises(RuntimeError, match="hook failed"):
        acc.backward(ce(model, x[2:4], y[2:4]))
    handle.remove()
    assert acc.optimizer_steps == 1 and sched.last_epoch == 1
    acc.backward(ce(model, x[4:6], y[4:6]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched.step()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="this window is dropped"):
        acc.backward(ce(model, x[6:], y[6:]))
    assert acc.optimizer_steps == 1 and sched.last_epoch == 2  # the loop's step only
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("scheduler", [False, True])
def test_a_dropped_accumulator_and_its_optimizer_are_freed_without_the_cyclic_collector(scheduler):
    # A cycle (optimizer -> its step hook -> the guard -> the optimizer) left them to the cyclic
    # collector, which freed a model's memory at a time no one chose: `gradaccum bench`'s memory
    # rows moved by megabytes between runs.
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1) if scheduler else None
    acc = gradaccum.Accumulator(opt, 2, model=model, scheduler=sched, clip_norm=1.0)
    x, y = data(8)
    for xb, yb in zip(x.split(4), y.split(4), strict=True):
        acc.backward(ce(model, xb, yb))
    refs = [weakref.ref(acc), weakref.ref(opt)]
    gc.collect()
    gc.disable()
    try:
        del acc, opt, sched
        assert [r() is None for r in refs] == [True, True]
    finally:
        gc.enable()


def test_a_backward_that_raised_half_way_is_refused_at_the_next_micro_batch_naming_it():
    # Its gradients partly added (here: the head's, before the hook on the body's output raised),
    # the window is refused until discarded, and the message names that cause.
    model = Net()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=LR), 4, model=model)
    x, y = data(12)
    acc.backward(ce(model, x[:4], y[:4]))
    h = torch.tanh(model.body(x[4:8]))
    h.register_hook(lambda _: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        acc.backward(nn.functional.cross_entropy(model.head(h), y[4:8]))
    assert acc.micro_step == 1
    with pytest.raises(RuntimeError, match=r"^the gradient of parameter 'head\.weight' was changed in place.*"
                                           r"one of the accumulator's that raised half-way"):
        acc.backward(ce(model, x[8:], y[8:]))
    acc.discard()
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())
