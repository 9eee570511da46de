"""Rank side of tests/distributed/test_one_rank_guard.py: a guard that refuses on one rank only.

Rank 1 alone makes a mistake the guards catch (its own ``zero_grad()`` or an in-place edit of a
gradient mid-window, a stale gradient before a window, its own ``scheduler.step()``); rank 0 feeds
cleanly. Each scenario runs on a process group of its own with a 5 s timeout, so a rank left
waiting in a collective fails the scenario instead of hanging the run. Every rank records what
its window raised, whether the window was dropped (the parameters as before it, no step, an
empty window), and whether a clean window afterwards steps alike on both ranks.
Run as ``python -m tests.distributed.guard_ranks OUT`` under the torchrun environment (see
tests/ranks.py).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.functional import cross_entropy
from torch.nn.parallel import DistributedDataParallel as DDP

import gradaccum
from tests.ranks import run_scenarios
from tests.reference import data, make_optimizer, mlp, reference_steps

MICRO = 4
TIMEOUT_S = 5  # of each scenario's process group: a rank left waiting fails within it


def own_group() -> Any:
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def build(kind: str, sync: str, steps: int, clip: float | None) -> tuple[Any, Any, Any, Any]:
    """(model the forward runs through, its plain module, accumulator, scheduler) on a new group."""
    group = own_group()
    if kind == "ddp":
        model = DDP(mlp(), process_group=group)
        inner = model.module
    else:
        inner = model = mlp()
        mesh = DeviceMesh.from_group(group, "cpu")
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = make_optimizer("adamw", model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = gradaccum.Accumulator(opt, steps, model=model, sync=sync, clip_norm=clip, scheduler=sched)
    return model, inner, acc, sched


def one_rank_mistake(rank: int, world: int, kind: str, mistake: str, sync: str = "window",
                     steps: int = 3, clip: float | None = None, end: str = "backward") -> dict[str, Any]:
    """A window where rank 1 alone makes ``mistake``; ``end="flush"`` flushes it one micro-batch
    short. Then a clean window."""
    model, inner, acc, sched = build(kind, sync, steps, clip)
    opt = acc.optimizer
    x, y = data(world * steps * MICRO, seed=300)
    fed = [(xb, yb) for xb, yb in zip(x.split(MICRO)[rank::world], y.split(MICRO)[rank::world], strict=True)]
    if mistake == "stale" and rank == 1:  # a gradient left over from before the loop
        inner[2].bias.grad = torch.ones_like(inner[2].bias)
    before = full_params(model)
    error = ""
    try:
        n = steps - 1 if end == "flush" else steps
        for i, (xb, yb) in enumerate(fed[:n]):
            acc.backward(cross_entropy(model(xb), yb))
            if rank == 1 and i == 0:
                if mistake == "zero_grad":
                    opt.zero_grad()
                elif mistake == "edit":
                    inner[2].bias.grad.mul_(2)
                elif mistake == "scheduler":
                    sched.step()
        if end == "flush":
            acc.flush()
    except RuntimeError as e:
        error = str(e)
    after = full_params(model)
    out: dict[str, Any] = {
        "raised": error, "dropped": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "optimizer_steps": acc.optimizer_steps, "micro_step": acc.micro_step}
    acc.discard()  # the message's fix; the window is already dropped
    for xb, yb in fed[:steps]:  # a clean window: both ranks step alike
        out["clean_stepped"] = acc.backward(cross_entropy(model(xb), yb))
    out["clean_params"] = full_params(model)
    ref = mlp()  # the clean window from the start: one full-batch step, as if the dropped one never ran
    reference_steps(ref, make_optimizer("adamw", ref.parameters()), [(x, y)], clip_norm=clip)
    out["ref_params"] = [p.detach().clone() for p in ref.parameters()]
    return out


def nan_loss(rank: int, world: int) -> dict[str, Any]:
    """No mistake: rank 1's loss is NaN in one micro-batch, under skip_nonfinite. The reduced loss
    sum is NaN as for a refusal; the ranks find that no rank refused, and the window is skipped
    on both, as before."""
    group = own_group()
    model = DDP(mlp(), process_group=group)
    acc = gradaccum.Accumulator(make_optimizer("adamw", model.parameters()), 2, model=model,
                                skip_nonfinite=True)
    x, y = data(world * 2 * MICRO, seed=310)
    raised = ""
    try:
        mine = zip(x.split(MICRO)[rank::world], y.split(MICRO)[rank::world], strict=True)
        for i, (xb, yb) in enumerate(mine):
            loss = cross_entropy(model(xb), yb)
            acc.backward(loss * float("nan") if rank == 1 and i == 0 else loss)
    except RuntimeError as e:
        raised = str(e)
    return {"raised": raised, "skipped": acc.skipped_windows, "optimizer_steps": acc.optimizer_steps}


SCENARIOS = {
    # DDP: rank 1's zero_grad() is seen before the window's last micro-batch, whose backward
    # all-reduces; an in-place edit, the same; a stale gradient at the first micro-batch of a
    # window of one (its backward is the all-reduce); its own scheduler.step(), at the boundary
    # (before the window's small all-reduce); an edit seen by flush() (before its agreement).
    "ddp_zero_grad": {"kind": "ddp", "mistake": "zero_grad"},
    "ddp_edit": {"kind": "ddp", "mistake": "edit"},
    "ddp_stale_window_of_one": {"kind": "ddp", "mistake": "stale", "steps": 1},
    "ddp_scheduler": {"kind": "ddp", "mistake": "scheduler"},
    "ddp_edit_flush": {"kind": "ddp", "mistake": "edit", "end": "flush"},
    "ddp_micro_batch_zero_grad": {"kind": "ddp", "mistake": "zero_grad", "sync": "micro_batch"},
    # FSDP2 with clipping (the norm is a collective at the boundary): "micro_batch" keeps the
    # sharded .grad between micro-batches, where zero_grad() is seen; "window" holds the window's
    # gradients inside FSDP2, and rank 1's scheduler.step() is seen at the boundary.
    "fsdp_micro_batch_zero_grad": {"kind": "fsdp", "mistake": "zero_grad", "sync": "micro_batch",
                                   "clip": 0.2},
    "fsdp_window_scheduler": {"kind": "fsdp", "mistake": "scheduler", "clip": 0.2},
    "fsdp_stale_window_of_one": {"kind": "fsdp", "mistake": "stale", "sync": "micro_batch", "steps": 1,
                                 "clip": 0.2},
}


if __name__ == "__main__":
    mistakes = {name: (lambda r, w, kw=kw: one_rank_mistake(r, w, **kw)) for name, kw in SCENARIOS.items()}
    run_scenarios({**mistakes, "nan_loss": nan_loss})
