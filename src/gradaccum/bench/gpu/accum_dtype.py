"""Check 6, ``accum_dtype=torch.float32`` with bf16 parameters: its error and its memory.

Error: a small GPT in bfloat16 computes the gradients of N micro-batches once; two accumulators
then sum *the same* gradients (each fed through a surrogate loss ``sum(p * g)``, whose gradient
is exactly ``g``): plain bf16 accumulation in ``.grad`` and ``accum_dtype=torch.float32``. What
each hands the optimizer (a bf16 ``.grad`` either way) is compared with the float64 mean of the
micro-batch gradients (relative L2 over all parameters). Target: float32 accumulation is closer.

Memory: one window of real micro-batches with each accumulator, from the same weights. Between
micro-steps the float32 run holds its buffers *instead of* a bf16 ``.grad``: the buffers are what
it holds beyond the plain run's memory less that ``.grad``, and the target is exactly one float32
copy of the bf16 gradients (4 bytes per trainable element, each buffer rounded up to the
allocator's 512-byte block on CUDA). At its peak (inside a backward, or at the boundary's cast
into ``.grad``) it holds them beside some or all of a bf16 gradient: the peak grows by at least
one bf16 copy and at most one float32 copy (on an H200 it grew by exactly one bf16 copy).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from gradaccum import Accumulator
from gradaccum.bench.gpu.check import Context, Outcome, alloc_bytes, peak, rel_l2
from gradaccum.bench.gpu.gpt import GPT_SMALL, GPT_TINY, gpt_loss, token_batches
from gradaccum.demos.gpt import GPT

__all__ = ["run"]

Grads = list[torch.Tensor]
MEMORY_STEPS = 4


def _micro_grads(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Grads]:
    """Each micro-batch's gradient of its mean loss, as bf16 autograd gives it."""
    out = []
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        torch.autograd.backward(gpt_loss(model(x)[0].float(), y))
        out.append([p.grad.detach().clone() for p in model.parameters()])  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return out


def _received(model: nn.Module, parts: list[Grads], accum_dtype: torch.dtype | None) -> Grads:
    """Feed ``parts`` through an Accumulator; return the gradients its optimizer step receives."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.0)
    got: Grads = []
    opt.register_step_pre_hook(lambda *_: got.extend(p.grad.detach().clone() for p in params))  # type: ignore[union-attr]
    acc = Accumulator(opt, len(parts), accum_dtype=accum_dtype)
    for grads in parts:
        acc.backward(sum((p * g).sum() for p, g in zip(params, grads, strict=True)))  # type: ignore[arg-type]
    if acc.optimizer_steps != 1:
        raise RuntimeError(f"expected one optimizer step, got {acc.optimizer_steps}")
    return got


def _window_memory(ctx: Context, model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                   accum_dtype: torch.dtype | None) -> tuple[int, int]:
    """(peak of one window, bytes still held after its first micro-step), relative to the start."""
    model = copy.deepcopy(model)
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.0), len(batches), accum_dtype=accum_dtype)

    def first() -> None:
        x, y = batches[0]
        acc.backward(gpt_loss(model(x)[0].float(), y))

    def rest() -> None:
        for x, y in batches[1:]:
            acc.backward(gpt_loss(model(x)[0].float(), y))

    held = peak(first, ctx.device)
    after = peak(rest, ctx.device)
    return max(held.peak, held.end + after.peak), held.end


def run(ctx: Context) -> Outcome:
    """Error against float64 for both accumulators, then the memory of each."""
    config, micro, steps = (GPT_TINY, 2, 16) if ctx.smoke else (GPT_SMALL, 8, 64)
    torch.manual_seed(0)
    model = GPT(config).to(device=ctx.device, dtype=torch.bfloat16)
    batches = token_batches(config, micro, steps, ctx.device)
    parts = _micro_grads(model, batches)
    reference = [torch.stack([g[i].double() for g in parts]).mean(0) for i in range(len(parts[0]))]
    errors = {name: rel_l2(_received(copy.deepcopy(model), parts, dtype), reference)
              for name, dtype in (("bf16 .grad", None), ("float32 buffers", torch.float32))}
    ctx.record(model=config.__dict__, micro_batch=micro, steps=steps, relative_l2_error=errors)
    trainable = [p for p in model.parameters() if p.requires_grad]
    one_copy = alloc_bytes(trainable, ctx.device, itemsize=4)
    bf16_copy = alloc_bytes(trainable, ctx.device)
    mem = {name: _window_memory(ctx, model, batches[:MEMORY_STEPS], dtype)
           for name, dtype in (("bf16 .grad", None), ("float32 buffers", torch.float32))}
    peak_diff = mem["float32 buffers"][0] - mem["bf16 .grad"][0]
    buffers = mem["float32 buffers"][1] - (mem["bf16 .grad"][1] - bf16_copy)
    ctx.record(fp32_copy_bytes=one_copy, bf16_grad_bytes=bf16_copy,
               peak_bytes={k: v[0] for k, v in mem.items()},
               held_after_micro_step_bytes={k: v[1] for k, v in mem.items()},
               peak_diff_bytes=peak_diff, buffer_bytes=buffers)
    ratio = errors["bf16 .grad"] / errors["float32 buffers"]
    measured = (f"N={steps}: error {errors['float32 buffers']:.2e} vs bf16 {errors['bf16 .grad']:.2e} "
                f"({ratio:.1f}x lower); buffers {buffers:,} B (one fp32 copy: {one_copy:,} B); "
                f"peak {peak_diff:+,} B ({peak_diff / sum(p.numel() for p in trainable):.2f} B per element)")
    met = (errors["float32 buffers"] < errors["bf16 .grad"] and buffers == one_copy
           and bf16_copy <= peak_diff <= one_copy)
    return Outcome(measured, "error below bf16's; buffers = one fp32 copy; peak + <= one fp32 copy", met)
