"""Rank side of tests/distributed/test_moe_ddp.py: LoadBalance under DDP (and FSDP2) on gloo ranks.

Every rank draws the same windows of 6 uneven, padded micro-batches; rank r trains micro-batches
``3r .. 3r+2`` of each through a DDP (or FSDP2) model with ``acc.backward``, and computes the
one-process reference on all 6 itself (tests/moe/models.py: the whole window's loss written out).
Run as ``python -m tests.distributed.moe_ranks OUT`` under the torchrun environment
(tests/ranks.py).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradaccum
from tests.moe.models import (
    CLIP,
    batches,
    count,
    lm_loss,
    make_opt,
    max_diff,
    qwen3_moe,
    reference,
    tiny_moe,
)
from tests.ranks import run_scenarios

WINDOWS, STEPS = 3, 3
SIZES = (3, 3, 2, 2, 3, 1)  # the window's 6 micro-batches: rank 0 takes the first 3


def wrap(model: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:  # type: ignore[union-attr]
            fully_shard(layer)
        return fully_shard(model)  # type: ignore[no-any-return]
    return DDP(model, find_unused_parameters=True)


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        full = getattr(p, "full_tensor", None)
        out.append((full() if full is not None else p).detach().clone())
    return out


def train_ranks(rank: int, world: int, make: Any, mode: str, how: str = "ddp", **kw: Any) -> dict[str, Any]:
    base = make()
    windows = [batches(w, SIZES, seed=5) for w in range(WINDOWS)]
    ref = reference(base, windows, mode, top_k=2, ranks=world, **{k: v for k, v in kw.items()
                                                                    if k in ("per_layer", "coef")})
    model = wrap(copy.deepcopy(base), how)
    opt, sched = make_opt(model)
    acc = gradaccum.Accumulator(opt, STEPS, clip_norm=CLIP, scheduler=sched, model=model)
    inner = getattr(model, "module", model)
    routers = inner.routers if hasattr(inner, "routers") else None
    balance = gradaccum.moe.LoadBalance(model, mode=mode, routers=routers, **kw)
    mine = [b for micro in windows for b in micro[rank * STEPS:(rank + 1) * STEPS]]
    norms: list[float] = []
    acc.register_boundary_hook(lambda a: norms.append(float(a.grad_norm)))
    loads = []
    for window in balance.windows(mine, acc, n_items=count):
        for batch in window:
            out = model(**batch)
            logits = out["logits"] if isinstance(out, dict) else out.logits
            acc.backward(lm_loss(logits, batch["labels"]), n_items=count(batch))
        loads.append(None)
    return {"diff": max_diff(full_params(model), ref["params"]), "norms": norms, "ref_norms": ref["norms"],
            "steps": acc.optimizer_steps, "load": balance.load, "loads": len(loads)}


def tiny(rank: int, world: int, mode: str, how: str = "ddp") -> dict[str, Any]:
    return train_ranks(rank, world, tiny_moe, mode, how, top_k=2, coef=0.5, per_layer=True)


if __name__ == "__main__":
    run_scenarios({
        "tiny_global": lambda r, w: tiny(r, w, "global"),
        "tiny_rolling": lambda r, w: tiny(r, w, "rolling"),
        "tiny_micro_batch": lambda r, w: tiny(r, w, "micro_batch"),
        "qwen3_global": lambda r, w: train_ranks(r, w, qwen3_moe, "global"),
        "tiny_fsdp_global": lambda r, w: tiny(r, w, "global", "fsdp"),
    }, timeout_s=120.0)
