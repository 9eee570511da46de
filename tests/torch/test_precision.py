"""A non-finite gradient drops the whole window: under a GradScaler, or with skip_nonfinite."""

import pytest
import torch
from torch import nn

import gradaccum
from tests.reference import (
    assert_params_close,
    bitwise_equal,
    clone_model,
    data,
    mlp,
    reference_steps,
    snapshot,
)

MICRO = 4
STEPS = 4
INF = float("inf")


def build(model, *, scaler=None, clip_norm=None, opt="sgd", **options):
    if opt == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:  # "fused": the optimizer skips the step itself, from the scaler's found_inf
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                                      fused=opt == "fused")
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    acc = gradaccum.Accumulator(optimizer, STEPS, scheduler=sched, scaler=scaler, clip_norm=clip_norm,
                                **options)
    return optimizer, sched, acc


def poisoned_loss(model, xb, yb, poison):
    """The micro-batch loss; ``"inf"`` multiplies it by inf, ``"nan"`` poisons one gradient."""
    loss = nn.functional.cross_entropy(model(xb), yb)
    if poison == "inf":
        return loss * INF
    if poison == "nan":
        weight = next(model.parameters())
        model._poison_handle = weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    return loss


def feed(model, acc, x, y, poison_at=None, poison="inf"):
    """Feed micro-batches; the one at index ``poison_at`` gets a non-finite gradient."""
    results = []
    for i, (xb, yb) in enumerate(zip(x.split(MICRO), y.split(MICRO), strict=True)):
        loss = poisoned_loss(model, xb, yb, poison if i == poison_at else None)
        results.append(acc.backward(loss))
        handle = getattr(model, "_poison_handle", None)
        if handle is not None:
            handle.remove()
            del model._poison_handle
    return results


def optimizer_tensors(opt):
    return [t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("poison", ["inf", "nan"])
@pytest.mark.parametrize("clip_norm", [None, 1.0])
@pytest.mark.parametrize("where", [0, 2, STEPS - 1])
@pytest.mark.parametrize("opt", ["sgd", "adamw", "fused"])
def test_scaler_skips_the_whole_window_with_a_non_finite_micro_batch(where, clip_norm, poison, opt):
    model = mlp(torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer, sched, acc = build(model, scaler=scaler, clip_norm=clip_norm, opt=opt)
    x, y = data(3 * STEPS * MICRO, torch.float32)
    xs, ys = x.split(STEPS * MICRO), y.split(STEPS * MICRO)
    assert feed(model, acc, xs[0], ys[0])[-1] is True  # a first window builds optimizer state
    params, state, lr = snapshot(model), optimizer_tensors(optimizer), sched.get_last_lr()
    scale = scaler.get_scale()

    stepped = feed(model, acc, xs[1], ys[1], poison_at=where, poison=poison)

    assert stepped == [False] * STEPS
    assert bitwise_equal(model, params)
    assert all(torch.equal(a, b) for a, b in zip(optimizer_tensors(optimizer), state, strict=True))
    assert (acc.optimizer_steps, acc.skipped_windows, acc.windows, acc.micro_step) == (1, 1, 2, 0)
    assert sched.get_last_lr() == lr
    assert scaler.get_scale() == scale * scaler.get_backoff_factor()
    assert all(p.grad is None for p in model.parameters())
    after = feed(model, acc, xs[2], ys[2])
    assert after[-1] is True and acc.optimizer_steps == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_window_after_a_skipped_one_equals_the_full_batch_step():
    model = mlp(torch.float64)
    ref = clone_model(model)
    x, y = data(3 * STEPS * MICRO)
    xs, ys = x.split(STEPS * MICRO), y.split(STEPS * MICRO)
    _, _, acc = build(model, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16), clip_norm=0.5)
    for i in range(3):
        feed(model, acc, xs[i], ys[i], poison_at=1 if i == 1 else None)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    reference_steps(ref, ref_opt, [(xs[0], ys[0]), (xs[2], ys[2])], clip_norm=0.5, scheduler=ref_sched)
    assert (acc.optimizer_steps, acc.skipped_windows) == (2, 1)
    assert_params_close(model, ref, torch.float64)


def test_injected_inf_corrupts_the_parameters_without_a_skip():
    # The negative twin: the same injection, with neither scaler nor skip_nonfinite, reaches the
    # parameters, so the checks above can fail.
    model = mlp(torch.float32)
    _, _, acc = build(model)
    x, y = data(STEPS * MICRO, torch.float32)
    assert feed(model, acc, x, y, poison_at=1)[-1] is True
    assert not all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("poison", ["inf", "nan"])
@pytest.mark.parametrize("clip_norm", [None, 1.0])
def test_skip_nonfinite_drops_the_window_without_a_scaler(clip_norm, poison):
    model = mlp(torch.float32)
    optimizer, sched, acc = build(model, clip_norm=clip_norm, skip_nonfinite=True)
    x, y = data(2 * STEPS * MICRO, torch.float32)
    xs, ys = x.split(STEPS * MICRO), y.split(STEPS * MICRO)
    params, lr = snapshot(model), sched.get_last_lr()
    assert feed(model, acc, xs[0], ys[0], poison_at=STEPS - 1, poison=poison) == [False] * STEPS
    assert bitwise_equal(model, params) and optimizer.state == {} and sched.get_last_lr() == lr
    assert (acc.optimizer_steps, acc.skipped_windows) == (0, 1)
    assert not torch.isfinite(acc.grad_norm)
    assert all(p.grad is None for p in model.parameters())
    assert feed(model, acc, xs[1], ys[1])[-1] is True
    assert (acc.optimizer_steps, acc.skipped_windows) == (1, 1)


def test_skip_nonfinite_reports_the_norm_it_computes():
    model = mlp()
    ref = clone_model(model)
    _, _, acc = build(model, skip_nonfinite=True)
    x, y = data(STEPS * MICRO)
    feed(model, acc, x, y)
    nn.functional.cross_entropy(ref(x), y).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    torch.testing.assert_close(acc.grad_norm, expected, atol=1e-12, rtol=0)


def test_skip_nonfinite_reuses_the_clipping_norm(monkeypatch):
    import gradaccum.torch._precision as precision

    def no_second_pass(*args, **kwargs):
        raise AssertionError("the clipping norm should have been reused")

    monkeypatch.setattr(precision, "get_total_norm", no_second_pass)
    model = mlp()
    _, _, acc = build(model, clip_norm=1.0, skip_nonfinite=True)
    x, y = data(STEPS * MICRO)
    assert feed(model, acc, x, y)[-1] is True


def test_flushed_window_with_an_inf_is_skipped():
    model = mlp(torch.float32)
    scaler = torch.amp.GradScaler("cpu")
    _, _, acc = build(model, scaler=scaler)
    x, y = data(2 * MICRO, torch.float32)
    params = snapshot(model)
    feed(model, acc, x, y, poison_at=0)
    assert acc.micro_step == 2
    assert acc.flush() is False
    assert bitwise_equal(model, params)
    assert (acc.optimizer_steps, acc.skipped_windows, acc.micro_step) == (0, 1, 0)
    assert scaler.get_scale() == 2.0**16 * scaler.get_backoff_factor()


def test_boundary_hook_sees_a_skipped_window():
    model = mlp(torch.float32)
    _, _, acc = build(model, skip_nonfinite=True)
    seen = []
    acc.register_boundary_hook(lambda a: seen.append((a.optimizer_steps, a.skipped_windows)))
    x, y = data(2 * STEPS * MICRO, torch.float32)
    feed(model, acc, x, y, poison_at=0)
    assert seen == [(0, 1), (1, 1)]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"skip_nonfinite": "yes"}, TypeError, "skip_nonfinite"),
    ({"skip_nonfinite": 1}, TypeError, "skip_nonfinite"),
    ({"accum_dtype": "float32"}, TypeError, "accum_dtype"),
    ({"accum_dtype": torch.bfloat16}, ValueError, "accum_dtype"),
    ({"accum_dtype": torch.int64}, ValueError, "accum_dtype"),
])
def test_bad_precision_options_are_refused(kwargs, error, match):
    model = mlp(torch.float32)
    with pytest.raises(error, match=match):
        gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, **kwargs)
