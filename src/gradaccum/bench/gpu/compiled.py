"""Check 7, ``torch.compile``: a compiled GPT trains through the Accumulator without recompiling.

A small GPT compiled with inductor trains 3 windows of 3 micro-batches and a flushed window of 2
under bf16 autocast, with everything that runs between the compiled forwards: ``n_items`` that
change every micro-step (padded sequences), ``clip_norm``, an LR scheduler, the boundary and
``flush()``. ``torch._dynamo.config.error_on_recompile`` turns any recompile into an error, and a
counting backend counts the graphs compiled (target: one, no recompile). An eager copy of the same
GPT trains on the same batches; the compiled run's parameter updates and window losses must agree
with it to bf16's tolerance (relative L2 <= 1.6e-2, torch.testing's bf16 rtol).

The smoke compiles with ``aot_eager`` (dynamo's capture and AOT autograd's backward graph,
without inductor's code generation, which takes tens of seconds on a CPU): the same guards, and
the same recompiles if the Accumulator caused any.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from gradaccum import Accumulator
from gradaccum.bench.gpu.check import Context, Outcome, rel_l2
from gradaccum.bench.gpu.gpt import GPT_SMALL, GPT_TINY, IGNORE, gpt_loss, token_batches
from gradaccum.demos.gpt import GPT

__all__ = ["run"]

STEPS, MICRO_BATCHES = 3, 11  # 3 full windows, then a flushed window of 2
TOLERANCE = 1.6e-2


def _train(ctx: Context, model: nn.Module, forward: nn.Module,
           batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Train ``model`` (through ``forward``: itself or its compiled form); the window losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    acc = Accumulator(opt, STEPS, clip_norm=1.0, scheduler=sched)
    losses = []
    for x, y in batches:
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            loss = gpt_loss(forward(x)[0], y)
        if acc.backward(loss, n_items=(y != IGNORE).sum()):
            losses.append(float(acc.window_loss))  # type: ignore[arg-type]
    if acc.flush():
        losses.append(float(acc.window_loss))  # type: ignore[arg-type]
    return losses


def run(ctx: Context) -> Outcome:
    """Compiled and eager runs from the same weights; graphs, recompiles, agreement."""
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = "aot_eager" if ctx.smoke else "inductor"
    config = GPT_TINY if ctx.smoke else GPT_SMALL
    torch.manual_seed(0)
    eager = GPT(config).to(ctx.device)
    start = [p.detach().clone() for p in eager.parameters()]
    model = copy.deepcopy(eager)
    batches = token_batches(config, 2 if ctx.smoke else 4, MICRO_BATCHES, ctx.device, padded=True)
    ctx.record(backend=backend, model=config.__dict__, steps=STEPS, micro_batches=MICRO_BATCHES)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter)
    recompiled = ""
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            losses = _train(ctx, model, compiled, batches)  # type: ignore[arg-type]
    except Exception as error:  # a recompile raises; anything else is a crash
        if "recompil" not in str(error).lower():
            raise
        recompiled, losses = str(error).splitlines()[0][:120], []
    ctx.record(graphs=counter.frame_count, recompile_error=recompiled, compiled_losses=losses)
    if recompiled:
        return Outcome(f"{backend}: recompiled: {recompiled}", "1 graph, no recompile; "
                       f"within {TOLERANCE} of eager", False)
    eager_losses = _train(ctx, eager, eager, batches)
    deltas = {name: [p.detach() - s for p, s in zip(m.parameters(), start, strict=True)]
              for name, m in (("compiled", model), ("eager", eager))}
    update_error = rel_l2(deltas["compiled"], deltas["eager"])
    loss_error = rel_l2([torch.tensor(losses)], [torch.tensor(eager_losses)])
    ctx.record(eager_losses=eager_losses, update_rel_l2=update_error, loss_rel_l2=loss_error)
    measured = (f"{backend}{' (smoke)' if ctx.smoke else ''}: {counter.frame_count} graph(s), "
                f"0 recompiles over {MICRO_BATCHES} micro-steps, {len(losses)} windows; vs eager: "
                f"updates {update_error:.1e}, losses {loss_error:.1e}")
    met = counter.frame_count == 1 and update_error <= TOLERANCE and loss_error <= TOLERANCE
    return Outcome(measured, f"1 graph, no recompile; within {TOLERANCE} of eager", met)
