"""Rank side of tests/torch/test_batchnorm_ddp.py: window BatchNorm under DDP on gloo ranks.

Run as ``python -m tests.torch.batchnorm_ranks OUT`` under the torchrun environment (see
tests/ranks.py). Trains two windows of two micro-batches with window BatchNorm, once with
sync=True and once with sync=False, and saves each BatchNorm's running statistics and recorded
inputs to ``OUT/rank{r}.pt``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradaccum
from tests.ranks import run_scenarios


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(48, 4), nn.BatchNorm1d(4)).to(torch.float64)


def run(rank: int, sync: bool) -> dict[str, Any]:
    model = DistributedDataParallel(net())
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.05), steps=2, model=model)
    model = gradaccum.window_batchnorm(model, acc, sync=sync)
    layers = [m for m in model.modules() if isinstance(m, gradaccum.WindowBatchNorm)]
    inputs: list[list[torch.Tensor]] = [[] for _ in layers]
    for layer, seen in zip(layers, inputs, strict=True):
        layer.register_forward_pre_hook(lambda m, a, seen=seen: seen.append(a[0].detach().clone()))
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(4):  # two windows; ranks see data with different means
        x = torch.randn(3 + rank, 2, 4, 4, generator=g, dtype=torch.float64) + 2.0 * rank
        acc.backward(model(x).pow(2).mean())
    stats = [t.clone() for m in layers for t in (m.running_mean, m.running_var, m.num_batches_tracked)]
    return {"stats": stats, "inputs": [torch.cat(seen) for seen in inputs]}


if __name__ == "__main__":
    run_scenarios({"sync": lambda rank, world: run(rank, True),
                   "local": lambda rank, world: run(rank, False)})
