"""Rank side of tests/distributed/test_pipeline.py: every 2-rank pipeline scenario, one launch.

Each scenario builds the stages and schedule afresh, trains through ``Accumulator.
backward_pipeline`` and compares every stage's parameters with the one-process reference of
tests/distributed/pipeline_model.py (every rank computes it: cheap at this size).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradaccum
from tests.distributed.pipeline_model import (
    count,
    full_model,
    layout,
    max_diff,
    reference,
    sgd,
    stage_params,
    token_mean,
    token_sum,
    window_batches,
    build,
)
from tests.ranks import run_scenarios

STEPS, N_MB, SEQS, WINDOWS = 3, 4, 8, 3


def train(rank: int, world: int, kind: str = "1f1b", *, pp: int | None = None, virtual: int = 1,
          reduction: str = "sum", items: bool = True, clip: float | None = 0.5, windows: int = WINDOWS,
          dp: str | None = None, **acc_kwargs: Any) -> dict[str, Any]:
    """``windows`` windows of ``STEPS`` calls; the stages' largest difference from the reference."""
    pp = world if pp is None else pp
    replicas = world // pp
    pp_group, dp_mesh, pp_rank, dp_rank = layout(world, pp)
    full = full_model(pp * virtual)
    wrap = None
    if dp == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        def wrap(m: nn.Module) -> nn.Module:
            return DDP(m, process_group=dp_mesh.get_group())
    elif dp == "fsdp":
        from torch.distributed.fsdp import fully_shard

        def wrap(m: nn.Module) -> nn.Module:
            return fully_shard(m, mesh=dp_mesh)
    loss_fn = token_sum if reduction == "sum" else token_mean
    schedule, mods = build(kind, full, pp_rank, pp, N_MB, loss_fn, virtual=virtual, pp_group=pp_group,
                           wrap=wrap)
    model = mods[0] if len(mods) == 1 else nn.ModuleList(mods)
    opt = sgd(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = gradaccum.Accumulator(opt, STEPS, model=model, clip_norm=clip, scheduler=sched, **acc_kwargs)
    first, last = pp_rank == 0, pp_rank == pp - 1
    data = [window_batches(w, STEPS, replicas, SEQS) for w in range(windows)]
    stepped, losses = [], []
    for w in range(windows):
        for tokens, labels in data[w][dp_rank]:
            done = acc.backward_pipeline(
                schedule, *((tokens,) if first else ()), target=labels if last else None,
                n_items=(count if items else None) if last else None, reduction=reduction)
            stepped.append(done)
        losses.append(float(acc.window_loss))
    ref, ref_losses = reference(pp * virtual, data, sgd, clip,
                                lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    return {"diff": max_diff(mods, stage_params(ref, pp_rank, pp, virtual)), "stepped": stepped,
            "losses": losses, "ref_losses": ref_losses, "lr": opt.param_groups[0]["lr"],
            "optimizer_steps": acc.optimizer_steps, "grad_norm": float(acc.grad_norm) if acc.grad_norm is not None else None}


if __name__ == "__main__":
    run_scenarios({
        "gpipe_sum_clip": lambda r, w: train(r, w, "gpipe"),
        "1f1b_sum_clip": lambda r, w: train(r, w, "1f1b"),
        "1f1b_mean_noclip": lambda r, w: train(r, w, "1f1b", reduction="mean", clip=None),
        "interleaved_mean_clip": lambda r, w: train(r, w, "interleaved", virtual=2, reduction="mean"),
    })
