"""All or nothing: what cannot work per window is refused at construction, an exception at a
boundary never re-applies a window, a bad checkpoint changes nothing, a closed handle refuses."""

import math

import pytest
import torch
from torch import nn

import gradaccum
from tests.reference import bitwise_equal, data, mlp, snapshot


def loss_of(model, seed=0):
    x, y = data(4, seed=seed)
    return nn.functional.cross_entropy(model(x), y)


def test_metric_scheduler_and_closure_optimizer_are_refused_at_construction():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"scheduler ReduceLROnPlateau\.step needs metrics"):
        gradaccum.Accumulator(opt, 2, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(TypeError, match="optimizer LBFGS needs a closure"):
        gradaccum.Accumulator(torch.optim.LBFGS(model.parameters()), 2)
    # A scheduler wraps the optimizer's step; that wrapper is no closure requirement.
    gradaccum.Accumulator(opt, 2, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))


class FailingScheduler(torch.optim.lr_scheduler.StepLR):
    fail = False  # set on the instance: the constructor steps once itself

    def step(self, epoch=None):
        super().step(epoch)
        if self.fail:
            self.fail = False
            raise RuntimeError("scheduler failed")


class FailingSGD(torch.optim.SGD):
    fail = True

    def step(self, closure=None):
        if self.fail:
            self.fail = False
            raise RuntimeError("optimizer failed")
        return super().step(closure)


def fresh_window_then_one_step(acc, model, steps):
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())
    before_steps, before = acc.optimizer_steps, snapshot(model)
    for i in range(steps - 1):
        assert acc.backward(loss_of(model, seed=10 + i)) is False
        assert bitwise_equal(model, before)  # the failed window is not applied again
    assert acc.backward(loss_of(model, seed=20)) is True
    assert acc.optimizer_steps == before_steps + 1


def test_scheduler_error_at_the_boundary_leaves_a_fresh_window():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = FailingScheduler(opt, 1)
    sched.fail = True
    acc = gradaccum.Accumulator(opt, 3, scheduler=sched)
    acc.backward(loss_of(model))
    acc.backward(loss_of(model, 1))
    with pytest.raises(RuntimeError, match="scheduler failed"):
        acc.backward(loss_of(model, 2))
    assert acc.optimizer_steps == 1  # the optimizer did step before the scheduler raised
    fresh_window_then_one_step(acc, model, 3)


@pytest.mark.parametrize("scaled", [False, True])
def test_optimizer_error_at_the_boundary_leaves_a_fresh_window(scaled):
    model = mlp()
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    acc = gradaccum.Accumulator(FailingSGD(model.parameters(), lr=0.1), 2, scaler=scaler)
    before = snapshot(model)
    acc.backward(loss_of(model))
    with pytest.raises(RuntimeError, match="optimizer failed"):
        acc.backward(loss_of(model, 1))
    assert acc.optimizer_steps == 0 and bitwise_equal(model, before)
    fresh_window_then_one_step(acc, model, 2)  # with a scaler: no "unscale_() already called"


def test_boundary_hook_error_leaves_a_fresh_window():
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    calls = []

    def hook(a):
        calls.append(a.optimizer_steps)
        if len(calls) == 1:
            raise ValueError("hook failed")

    acc.register_boundary_hook(hook)
    acc.backward(loss_of(model))
    with pytest.raises(ValueError, match="hook failed"):
        acc.backward(loss_of(model, 1))
    assert acc.optimizer_steps == 1
    fresh_window_then_one_step(acc, model, 2)
    assert calls == [1, 2]


def mid_window(dtype_items=False):
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    for i in range(4):  # one full window, then one micro-batch
        acc.backward(loss_of(model, i), n_items=torch.tensor(4) if dtype_items else 4)
    return model, acc


def corrupt(state, path, value):
    state = {**state, "window": dict(state["window"]), "grads": list(state["grads"])}
    target = state
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return state


@pytest.mark.parametrize("path, value", [
    (("optimizer_steps",), KeyError),
    (("epoch",), KeyError),
    (("window", "micro_step"), 7),
    (("window", "micro_step"), -1),
    (("window", "micro_step"), "1"),
    (("window", "weighting"), "median"),
    (("window", "weighting"), "mean"),  # items with a mean window
    (("window", "items"), -3),
    (("optimizer_steps",), "x"),
    (("optimizer_steps",), -5),
    (("skipped_windows",), 1.5),
    (("grads", 2), torch.zeros(3)),
    (("grads", 0), "grad"),
    (("window_loss",), "0.5"),
    (("loss_sum",), torch.ones(2)),
    (("window", "size"), 0),
])
def test_a_corrupted_state_raises_and_changes_nothing(path, value):
    _, acc = mid_window()
    good = acc.state_dict()
    model2, acc2 = mid_window()
    for p in model2.parameters():  # other partial gradients, to see that none is overwritten
        p.grad.mul_(3)
    grads, counters = [p.grad.clone() for p in model2.parameters()], repr(acc2)
    key = path[-1] if isinstance(path[-1], str) else "grads"
    with pytest.raises((TypeError, ValueError), match=key):
        acc2.load_state_dict(corrupt(good, path, value))
    assert all(torch.equal(p.grad, g) for p, g in zip(model2.parameters(), grads, strict=True))
    assert repr(acc2) == counters and acc2.window_loss is not None


def test_window_loss_survives_a_resume():
    _, acc = mid_window()
    want = acc.window_loss
    fresh = gradaccum.Accumulator(torch.optim.SGD(mlp().parameters(), lr=0.1), 3)
    fresh.load_state_dict(acc.state_dict())
    assert torch.equal(fresh.window_loss, want)
    assert math.isfinite(float(fresh.window_loss))


def test_a_closed_micro_batch_handle_refuses():
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    with acc.micro_batch() as mb:
        mb.backward(loss_of(model))
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="ended"):
        mb.backward(loss_of(model, 1))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert acc.micro_step == 1


def test_an_error_inside_a_micro_batch_block_closes_the_handle_and_counts_nothing():
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    with pytest.raises(KeyError), acc.micro_batch() as mb:
        mb.backward(loss_of(model))
        raise KeyError("task 2")
    assert mb.closed and acc.micro_step == 0
    acc.discard()
    assert all(p.grad is None for p in model.parameters())


def grad_like(p, **kw):
    return torch.zeros(p.shape, **kw)


@pytest.mark.parametrize("make, match", [
    (lambda p: grad_like(p, device="meta"), "dense tensor with values"),
    (lambda p: grad_like(p).to_sparse(), "dense tensor with values"),
    (lambda p: grad_like(p, dtype=torch.int64), "real floating tensor"),
    (lambda p: grad_like(p, dtype=torch.bool), "real floating tensor"),
    (lambda p: grad_like(p, dtype=torch.complex64), "real floating tensor"),
    (lambda p: grad_like(p, dtype=torch.float16), "dtype torch.float16, its parameter torch.float"),
])
def test_a_gradient_no_parameter_can_take_is_refused_before_any_is_restored(make, match):
    # 0.2.0 accepted a meta or sparse gradient, then raised after overwriting the first ones, and
    # cast int64, bool and complex gradients silently.
    model, acc = mid_window()
    state = acc.state_dict()
    last = len(state["grads"]) - 1
    state["grads"][last] = make(list(model.parameters())[last])
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        acc.load_state_dict(state)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


@pytest.mark.parametrize("key, value", [
    (("window", "items"), torch.tensor(float("nan"))),
    (("window", "items"), torch.tensor(-4.0)),
    (("window", "scale"), torch.tensor(float("inf"))),
    (("window", "basis"), torch.tensor(-1.0)),
    (("window", "basis"), float("nan")),
])
def test_tensor_valued_counts_are_range_checked_like_their_number_twins(key, value):
    _, acc = mid_window(dtype_items=True)
    state = corrupt(acc.state_dict(), key, value)
    before = repr(acc)
    with pytest.raises(ValueError, match=key[-1]):
        acc.load_state_dict(state)
    assert repr(acc) == before


@pytest.mark.parametrize("n_items", [1e308, 2**60, torch.tensor(2**60),
                                     torch.tensor(1e308, dtype=torch.float64)])
def test_counts_that_cannot_stay_exact_are_refused_as_numbers_and_tensors(n_items):
    model, acc = mid_window()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="2\\*\\*53"):
        acc.backward(loss_of(model, 5), n_items)
    assert acc.micro_step == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


def test_a_window_total_past_the_exact_range_is_refused_at_the_micro_batch():
    model = mlp()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    acc.backward(loss_of(model), 2**52 + 2**51)
    with pytest.raises(ValueError, match="item total"):
        acc.backward(loss_of(model, 1), 2**52)
    assert acc.micro_step == 1


@pytest.mark.parametrize("scaled", [False, True])
def test_a_step_followed_by_a_raising_post_hook_is_counted_and_scheduled(scaled):
    # The optimizer stepped, then its post-hook raised: the parameters moved, so the step counts,
    # the scheduler steps, the error still reaches the caller, and the next window starts fresh.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    acc = gradaccum.Accumulator(opt, 2, scheduler=sched, scaler=scaler)
    handle = opt.register_step_post_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("post-hook")))
    before = snapshot(model)
    acc.backward(loss_of(model))
    with pytest.raises(RuntimeError, match="post-hook"):
        acc.backward(loss_of(model, 1))
    assert not bitwise_equal(model, before)
    assert (acc.optimizer_steps, sched.last_epoch, acc.micro_step) == (1, 1, 0)
    handle.remove()
    acc.backward(loss_of(model, 2))
    assert acc.backward(loss_of(model, 3)) and acc.optimizer_steps == 2


def test_a_step_that_raises_before_updating_is_not_counted():
    # Negative twin: a pre-hook raises before any parameter changes.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(opt, 1)
    opt.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("pre-hook")))
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="pre-hook"):
        acc.backward(loss_of(model))
    assert bitwise_equal(model, before) and acc.optimizer_steps == 0
