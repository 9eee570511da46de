"""Rank side of tests/distributed/test_items_ddp.py: summed losses, empty micro-batches and
windows, and the guard rails under DDP on gloo ranks.

Every rank draws the same global data, trains its share through a DDP model and computes the
one-process full-batch reference itself. Run as ``python -m tests.distributed.items_ranks OUT``
under the torchrun environment (see tests/ranks.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.functional import cross_entropy
from torch.nn.parallel import DistributedDataParallel as DDP

import gradaccum
from tests.ranks import run_scenarios
from tests.reference import bitwise_equal, data, make_optimizer, mlp, snapshot

MICRO = 4
# Valid samples per micro-batch, [window][rank][micro-batch]: uneven across ranks, some empty.
COUNTS = [
    [[4, 0, 2], [1, 3, 0]],
    [[0, 0, 0], [2, 4, 1]],  # rank 0 holds no item in the whole window
    [[3, 3, 3], [3, 3, 3]],
]


def summed_loss(model: Any, x: torch.Tensor, y: torch.Tensor, valid: int) -> torch.Tensor:
    """The loss summed over the first ``valid`` samples (the others are padding)."""
    mask = (torch.arange(len(y)) < valid).to(x.dtype)
    return (cross_entropy(model(x), y, reduction="none") * mask).sum()


def global_window(w: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return data(world * 3 * MICRO, seed=500 + w)


def reference(windows: list[list[list[int]]], world: int) -> list[torch.Tensor]:
    """One full-batch SGD step per window on the mean loss over every valid sample."""
    model = mlp()
    opt = make_optimizer("sgd", model.parameters())
    for w, counts in enumerate(windows):
        x, y = global_window(w, world)
        keep = torch.cat([torch.arange(MICRO) < c for rank in counts for c in rank])
        if not keep.any():
            continue  # no item: no step
        opt.zero_grad(set_to_none=True)
        cross_entropy(model(x[keep]), y[keep]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def summed_windows(rank: int, world: int, windows: list[list[list[int]]], tensors: bool) -> dict[str, Any]:
    ddp = DDP(mlp())
    acc = gradaccum.Accumulator(make_optimizer("sgd", ddp.parameters()), 3, model=ddp)
    stepped = []
    for w, counts in enumerate(windows):
        x, y = global_window(w, world)
        mine = list(zip(x.split(MICRO), y.split(MICRO), strict=True))[rank * 3:(rank + 1) * 3]
        for (xb, yb), c in zip(mine, counts[rank], strict=True):
            n: Any = torch.tensor(c) if tensors else c
            last = acc.backward(summed_loss(ddp, xb, yb, c), n, reduction="sum")
        stepped.append(last)
    return {"params": [p.detach().clone() for p in ddp.module.parameters()],
            "ref": reference(windows, world), "stepped": stepped, "steps": acc.optimizer_steps}


def all_empty(rank: int, world: int) -> dict[str, Any]:
    ddp = DDP(mlp())
    acc = gradaccum.Accumulator(make_optimizer("sgd", ddp.parameters()), 2, model=ddp)
    before = snapshot(ddp.module)
    x, y = global_window(0, world)
    out = [acc.backward(summed_loss(ddp, xb, yb, 0), 0, reduction="sum") for xb, yb in
           list(zip(x.split(MICRO), y.split(MICRO), strict=True))[rank * 2:(rank + 1) * 2]]
    return {"stepped": out, "unchanged": bitwise_equal(ddp.module, before),
            "steps": acc.optimizer_steps, "micro_step": acc.micro_step,
            "grads_none": all(p.grad is None for p in ddp.parameters())}


def raw_module_forward(rank: int, world: int) -> dict[str, Any]:
    ddp = DDP(mlp())
    acc = gradaccum.Accumulator(make_optimizer("sgd", ddp.parameters()), 2, model=ddp)
    before = snapshot(ddp.module)
    x, y = data(2 * MICRO, seed=600 + rank)
    acc.backward(cross_entropy(ddp.module(x[:MICRO]), y[:MICRO]))
    try:
        acc.backward(cross_entropy(ddp.module(x[MICRO:]), y[MICRO:]))
        outcome = "no error"
    except RuntimeError as e:
        outcome = str(e)
    unchanged = bitwise_equal(ddp.module, before)
    # The next window, through the wrapper, trains normally.
    for xb, yb in zip(x.split(MICRO), y.split(MICRO), strict=True):
        acc.backward(cross_entropy(ddp(xb), yb))
    return {"outcome": outcome, "unchanged_after_error": unchanged,
            "steps": acc.optimizer_steps, "micro_step": acc.micro_step}


def model_none_raises(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ddp = DDP(mlp())
    for name, model in (("none", None), ("module", ddp.module)):
        try:
            gradaccum.Accumulator(make_optimizer("sgd", ddp.parameters()), 2, model=model)
            out[name] = "no error"
        except ValueError as error:
            out[name] = str(error)
    # The opt-out: ranks that train independently on purpose.
    local = gradaccum.Accumulator(make_optimizer("sgd", mlp().parameters()), 2, sync="local")
    out["local_world"] = local.world_size
    return out


def fp16_skips(rank: int, world: int, mode: str, windows: int = 8, steps: int = 4) -> int:
    """Windows a GradScaler skips for fp16 autocast under DDP, with or without token counts."""
    torch.manual_seed(0)
    vocab, tokens = 50, 256
    ddp = DDP(torch.nn.Sequential(torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, 64), torch.nn.GELU(),
                                  torch.nn.Linear(64, vocab)))
    acc = gradaccum.Accumulator(torch.optim.SGD(ddp.parameters(), lr=1e-3), steps, model=ddp,
                                scaler=torch.amp.GradScaler("cpu"))
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(windows * steps):
        ids = torch.randint(0, vocab, (tokens,), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = cross_entropy(ddp(ids), ids)
        if mode == "scaled_by_n_over_N":  # what 0.2.0's first window under DDP did (P = N)
            loss = loss * (tokens / steps)
        acc.backward(loss, n_items=tokens if mode == "weighted" else None)
    return acc.skipped_windows


def fp16_first_window(rank: int, world: int) -> dict[str, Any]:
    return {mode: fp16_skips(rank, world, mode) for mode in ("plain", "weighted", "scaled_by_n_over_N")}


if __name__ == "__main__":
    run_scenarios({
        "summed_ints": lambda r, w: summed_windows(r, w, COUNTS, tensors=False),
        "summed_tensors": lambda r, w: summed_windows(r, w, COUNTS, tensors=True),
        "all_empty": all_empty,
        "raw_module_forward": raw_module_forward,
        "model_none_raises": model_none_raises,
        "fp16_first_window": fp16_first_window,
    })
