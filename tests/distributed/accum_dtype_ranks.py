"""Rank side of tests/distributed/test_accum_dtype_ddp.py: float32 (or float64) accumulation
under DDP, against one process on the global batch.

Run as ``python -m tests.distributed.accum_dtype_ranks OUT`` under the torchrun environment
(see tests/ranks.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.functional import cross_entropy
from torch.nn.parallel import DistributedDataParallel as DDP

import gradaccum
from tests.ranks import run_scenarios
from tests.reference import data, mlp

STEPS, MICRO, WINDOWS = 4, 4, 3


def train(model: Any, acc: gradaccum.Accumulator, rank: int, world: int, shards: int, steps: int,
          partial: bool) -> None:
    """WINDOWS windows of the global batch of ``world`` ranks (this process's contiguous share
    of ``shards``), and with ``partial`` a flushed half window."""
    for w in range(WINDOWS + partial):
        x, y = data(world * STEPS * MICRO, seed=300 + w)
        n = len(x) // shards
        mine = (x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        count = steps // 2 if w == WINDOWS else steps
        for xb, yb in list(zip(mine[0].split(MICRO), mine[1].split(MICRO), strict=True))[:count]:
            acc.backward(cross_entropy(model(xb.to(next(model.parameters()).dtype)), yb))
    if partial:
        acc.flush()


def one_process(dtype: torch.dtype, accum: torch.dtype, world: int, partial: bool) -> list[torch.Tensor]:
    model = mlp(dtype)
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), world * STEPS,
                                accum_dtype=accum, sync="local")
    train(model, acc, 0, world, 1, world * STEPS, partial)
    return [p.detach().clone() for p in model.parameters()]


def accumulate(rank: int, world: int, dtype: torch.dtype, accum: torch.dtype,
               partial: bool = False) -> dict[str, Any]:
    ddp = DDP(mlp(dtype))
    acc = gradaccum.Accumulator(torch.optim.SGD(ddp.parameters(), lr=0.1), STEPS, model=ddp,
                                accum_dtype=accum)
    train(ddp, acc, rank, world, world, STEPS, partial)
    buffers = acc._precision.buffers
    assert buffers is not None
    return {"params": [p.detach().clone() for p in ddp.module.parameters()],
            "ref": one_process(dtype, accum, world, partial), "steps": acc.optimizer_steps,
            "flag": ddp.require_backward_grad_sync, "buffer_bytes": buffers.nbytes,
            "wide_bytes": sum(p.numel() for p in ddp.parameters()) * accum.itemsize}


if __name__ == "__main__":
    run_scenarios({
        "float32_in_float64": lambda r, w: accumulate(r, w, torch.float32, torch.float64),
        "bf16_in_float32": lambda r, w: accumulate(r, w, torch.bfloat16, torch.float32),
        "bf16_flushed": lambda r, w: accumulate(r, w, torch.bfloat16, torch.float32, partial=True),
    })
