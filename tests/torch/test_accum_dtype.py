"""accum_dtype: bf16/fp16 gradients summed in float32 buffers, one rounding per window."""

import io

import pytest
import torch
from torch import nn

import gradaccum
from gradaccum.torch._accum_buffers import AccumBuffers
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


def loss_of(model, xb, yb):
    return nn.functional.cross_entropy(model(xb).float(), yb)


def micro_grads(model, x, y, steps):
    """Each micro-batch's gradient of ``loss / steps`` in the parameters' dtype, as autograd gives it."""
    out = []
    for xb, yb in zip(x.split(MICRO), y.split(MICRO), strict=True):
        model.zero_grad(set_to_none=True)
        (loss_of(model, xb, yb) * (1.0 / steps)).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def grads_at_step(acc):
    """Record the ``.grad`` the optimizer sees at each step."""
    seen = []
    acc.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append([p.grad.clone() for p in acc._params]))
    return seen


def feed(model, acc, x, y, n_items=False):
    return [acc.backward(loss_of(model, xb, yb), n_items=len(xb) if n_items else None)
            for xb, yb in zip(x.split(MICRO), y.split(MICRO), strict=True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_optimizer_gets_the_float32_sum_rounded_once(dtype):
    steps = 16
    model = mlp(dtype)
    x, y = data(steps * MICRO, dtype)
    parts = micro_grads(model, x, y, steps)
    # The same order of additions as the buffers: copy the first, then add one by one.
    expected = []
    for i in range(len(parts[0])):
        total = parts[0][i].float()
        for g in parts[1:]:
            total = total + g[i]
        expected.append(total.to(dtype))
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps,
                                accum_dtype=torch.float32)
    seen = grads_at_step(acc)
    assert feed(model, acc, x, y)[-1] is True
    assert all(torch.equal(a, b) for a, b in zip(seen[0], expected, strict=True))


def test_float32_buffers_are_far_closer_to_the_float64_sum_than_bf16():
    steps = 64
    model = mlp(torch.bfloat16)
    x, y = data(steps * MICRO, torch.bfloat16)
    parts = micro_grads(model, x, y, steps)
    exact = [torch.stack([g[i].double() for g in parts]).sum(0) for i in range(len(parts[0]))]
    wide = AccumBuffers(model.parameters(), torch.float32)
    narrow = [torch.zeros_like(p) for p in model.parameters()]
    for g in parts:
        for p, gi, n in zip(model.parameters(), g, narrow, strict=True):
            p.grad = gi.clone()
            n.add_(gi)  # what plain accumulation in .grad does
        wide.collect()

    def error(grads):
        return max(float((a.double() - e).abs().max() / e.abs().max()) for a, e in zip(grads, exact,
                                                                                     strict=True))
    assert error(wide.grads()) * 100 < error(narrow)


def test_one_buffer_per_narrow_parameter_allocated_on_first_use():
    model = nn.Sequential(nn.Linear(6, 8).bfloat16(), nn.Tanh(), nn.Linear(8, 3))  # last layer fp32
    frozen = nn.Parameter(torch.zeros(5, dtype=torch.bfloat16), requires_grad=False)
    opt = torch.optim.SGD([*model.parameters(), frozen], lr=0.1)
    acc = gradaccum.Accumulator(opt, 2, accum_dtype=torch.float32)
    bufs = acc._precision.buffers
    assert bufs.buffers is None and bufs.nbytes == 0
    x, y = data(6 * MICRO, torch.float32)

    def loss(xb, yb):
        return nn.functional.cross_entropy(model[2](model[1](model[0](xb.bfloat16()).float())), yb)

    acc.backward(loss(x[:MICRO], y[:MICRO]))
    narrow = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    assert bufs.nbytes == sum(4 * p.numel() for p in narrow)
    assert all(b.dtype == torch.float32 for b in bufs.buffers)
    assert [p.grad is None for p in model.parameters()] == [True, True, False, False]
    ptrs = [b.data_ptr() for b in bufs.buffers]
    for xb, yb in zip(x[MICRO:].split(MICRO), y[MICRO:].split(MICRO), strict=True):
        acc.backward(loss(xb, yb))
    assert acc.optimizer_steps == 3
    assert [b.data_ptr() for b in bufs.buffers] == ptrs  # never reallocated


@pytest.mark.parametrize("clip_norm", [None, 0.5])
@pytest.mark.parametrize("n_items", [False, True])
def test_wide_accumulation_equals_the_full_batch_step(n_items, clip_norm):
    # float32 parameters accumulated in float64: normalization, clipping and the flushed short
    # window all go through the buffers, and must give the full-batch float32 step.
    steps, windows = 4, 3
    model = mlp(torch.float32)
    ref = clone_model(model)
    x, y = data((windows * steps - 1) * MICRO, torch.float32)  # the last window is flushed short
    acc = gradaccum.Accumulator(torch.optim.AdamW(model.parameters(), lr=1e-2), steps,
                                clip_norm=clip_norm, accum_dtype=torch.float64)
    feed(model, acc, x, y, n_items)
    assert acc.flush() is True and acc.optimizer_steps == windows
    reference_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2),
                    list(zip(x.split(steps * MICRO), y.split(steps * MICRO), strict=True)),
                    loss_fn=lambda out, yb: nn.functional.cross_entropy(out.float(), yb),
                    clip_norm=clip_norm)
    assert_params_close(model, ref, torch.float32)


def test_parameters_are_bitwise_unchanged_mid_window():
    model = mlp(torch.bfloat16)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4, accum_dtype=torch.float32)
    x, y = data(3 * MICRO, torch.bfloat16)
    params = snapshot(model)
    assert feed(model, acc, x, y) == [False] * 3
    assert bitwise_equal(model, params)


def test_parameter_without_a_gradient_in_the_window_is_left_alone():
    model = mlp(torch.bfloat16)
    unused = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([*model.parameters(), unused], lr=1e-2, weight_decay=0.5)
    acc = gradaccum.Accumulator(opt, 2, accum_dtype=torch.float32)
    x, y = data(2 * MICRO, torch.bfloat16)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(unused.grad))
    assert feed(model, acc, x, y)[-1] is True
    assert seen == [None] and torch.equal(unused, torch.ones(3, dtype=torch.bfloat16))


def test_discard_forgets_the_buffers():
    model = mlp(torch.bfloat16)
    twin = clone_model(model)
    x, y = data(4 * MICRO, torch.bfloat16)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, accum_dtype=torch.float32)
    acc.backward(loss_of(model, x[:MICRO], y[:MICRO]) * 7)
    acc.discard()
    feed(model, acc, x[MICRO:3 * MICRO], y[MICRO:3 * MICRO])
    acc2 = gradaccum.Accumulator(torch.optim.SGD(twin.parameters(), lr=0.1), 2, accum_dtype=torch.float32)
    feed(twin, acc2, x[MICRO:3 * MICRO], y[MICRO:3 * MICRO])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


@pytest.mark.parametrize("n_items", [False, True])
def test_resume_mid_window_with_wide_buffers_is_bit_exact(n_items):
    def build(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return opt, gradaccum.Accumulator(opt, 4, accum_dtype=torch.float32)

    x, y = data(11 * MICRO, torch.bfloat16)
    cut = 6 * MICRO
    straight = mlp(torch.bfloat16)
    feed(straight, build(straight)[1], x, y, n_items)

    first = mlp(torch.bfloat16)
    opt, acc1 = build(first)
    feed(first, acc1, x[:cut], y[:cut], n_items)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict(), "acc": acc1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert saved["acc"]["accum"]["buffers"][0].dtype == torch.float32

    resumed = mlp(torch.bfloat16, seed=5)
    opt2, acc2 = build(resumed)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    acc2.load_state_dict(saved["acc"])
    feed(resumed, acc2, x[cut:], y[cut:], n_items)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))


def test_state_without_wide_buffers_is_refused_before_any_change():
    model = mlp(torch.bfloat16)
    x, y = data(MICRO, torch.bfloat16)
    plain = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4)
    feed(model, plain, x, y)
    state = plain.state_dict()
    wide = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4, accum_dtype=torch.float32)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="accum_dtype"):
        wide.load_state_dict(state)
    with pytest.raises(ValueError, match="accum_dtype"):
        plain.load_state_dict(wide.state_dict())
    assert wide.micro_step == 0 and plain.micro_step == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaler_with_wide_buffers_skips_an_inf_window(dtype):
    # fp16 gradients cannot go through GradScaler.unscale_ at all; in float32 buffers they can.
    model = mlp(dtype)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, scaler=scaler,
                                accum_dtype=torch.float32, clip_norm=1.0)
    x, y = data(4 * MICRO, dtype)
    params = snapshot(model)
    acc.backward(loss_of(model, x[:MICRO], y[:MICRO]))
    assert acc.backward(loss_of(model, x[MICRO:2 * MICRO], y[MICRO:2 * MICRO]) * float("inf")) is False
    assert bitwise_equal(model, params)
    assert (acc.optimizer_steps, acc.skipped_windows, scaler.get_scale()) == (0, 1, 2.0**7)
    assert all(p.grad is None for p in model.parameters())
    assert feed(model, acc, x[2 * MICRO:], y[2 * MICRO:])[-1] is True
    assert not bitwise_equal(model, params) and all(torch.isfinite(p).all() for p in model.parameters())


def test_scaler_with_wide_buffers_unscales_once():
    steps = 4
    model = mlp(torch.bfloat16)
    x, y = data(steps * MICRO, torch.bfloat16)
    parts = micro_grads(model, x, y, steps)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps,
                                scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12),
                                accum_dtype=torch.float32)
    seen = grads_at_step(acc)
    feed(model, acc, x, y)
    for i, g in enumerate(seen[0]):
        expected = torch.stack([p[i].double() for p in parts]).sum(0)
        torch.testing.assert_close(g.double(), expected, rtol=2**-7, atol=1e-6)


def test_wide_buffers_under_ddp_accepted_and_under_fsdp2_pointed_to_its_policy(tmp_path, monkeypatch):
    # DDP: the accumulator averages the float32 sums itself (tests/distributed/test_accum_dtype_ddp.py).
    # FSDP2 accumulates in reduce_dtype already: the message names MixedPrecisionPolicy.
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(mlp(torch.bfloat16))
        gradaccum.Accumulator(torch.optim.SGD(ddp.parameters(), lr=0.1), 2, model=ddp,
                              accum_dtype=torch.float32)
        sharded = fully_shard(mlp(torch.bfloat16))
        with pytest.raises(ValueError, match="MixedPrecisionPolicy"):
            gradaccum.Accumulator(torch.optim.SGD(sharded.parameters(), lr=0.1), 2, model=sharded,
                                  accum_dtype=torch.float32)
    finally:
        dist.destroy_process_group()
