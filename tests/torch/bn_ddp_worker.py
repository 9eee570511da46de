"""One rank of the window-BatchNorm DDP test (run by test_batchnorm_ddp.py, not collected).

Usage: python bn_ddp_worker.py RANK WORLD PORT OUT_DIR. Trains two windows of two micro-batches
under DDP (gloo) with window BatchNorm, once with sync=True and once with sync=False, and saves
each BatchNorm's running statistics and recorded inputs to OUT_DIR/rank{RANK}.pt.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradaccum


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(48, 4), nn.BatchNorm1d(4)).to(torch.float64)


def run(rank: int, sync: bool) -> dict[str, list[torch.Tensor]]:
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


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save({"sync": run(rank, True), "local": run(rank, False)}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
