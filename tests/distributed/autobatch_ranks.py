"""Rank side of tests/distributed/test_autobatch_ddp.py: AutoBatch under DDP on gloo ranks.

Run as ``python -m tests.distributed.autobatch_ranks OUT`` under the torchrun environment (see
tests/ranks.py); every scenario runs in one launch and the results go to ``OUT/rank{r}.pt``.
Out-of-memory errors are injected on one rank at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradaccum
from tests.ranks import run_scenarios
from tests.reference import data, mlp, reference_steps

GLOBAL, WINDOWS = 24, 4  # items per window over both ranks; windows


class FailAtCalls(nn.Module):
    """Identity with a buffer (so DDP broadcasts buffers) that raises an OOM on chosen calls."""

    def __init__(self, calls: tuple[int, ...] = (), limit: int = 10**9) -> None:
        super().__init__()
        self.register_buffer("unit", torch.ones((), dtype=torch.float64))
        self.fail, self.limit, self.calls = set(calls), limit, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls in self.fail or x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return x * self.unit


def setup(layer: nn.Module) -> tuple[nn.Module, gradaccum.Accumulator]:
    net = mlp(torch.float64)
    model = DDP(nn.Sequential(net[0], layer, *net[1:]))
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 1,
                                model=model)
    return model, acc


def shares(rank: int, world: int) -> tuple[list[Any], list[Any]]:
    """This rank's block of every window, and the whole windows (for the reference)."""
    x, y = data(GLOBAL * WINDOWS)
    windows = list(zip(x.split(GLOBAL), y.split(GLOBAL), strict=True))
    per = GLOBAL // world
    mine = [(wx[rank * per:(rank + 1) * per], wy[rank * per:(rank + 1) * per]) for wx, wy in windows]
    return mine, windows


def loss_of(model: nn.Module) -> Callable[[Any], torch.Tensor]:
    return lambda mb: nn.functional.cross_entropy(model(mb[0]), mb[1])


def recovers_on_both_ranks(rank: int, world: int) -> dict[str, Any]:
    # Per rank 12 items per window, start at micro-batch 4 (3 parts):
    # window 1 is the first at size 4 (nothing synced): rank 0 runs out in its last part (call 3);
    #   both rerun it at 2 (6 parts, nothing synced; calls 4-9);
    # window 2 at 2 syncs in its last part (calls 10-15), so DDP broadcasts buffers next forward;
    # window 3: rank 1 runs out in its first part (call 16), after DDP's buffer broadcast; both
    #   rerun at 1; window 4 at 1.
    layer = FailAtCalls(calls=(3,) if rank == 0 else (16,))
    model, acc = setup(layer)
    mine, windows = shares(rank, world)
    auto = gradaccum.AutoBatch(acc, "auto", start=4)
    steps = auto.run(mine, loss_of(model))
    ref = mlp(torch.float64)
    reference_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), windows)
    return {"steps": steps, "ooms": auto.ooms, "micro_batch": auto.micro_batch,
            "params": [p.detach().clone() for p in model.parameters()],
            "reference": [p.detach().clone() for p in ref.parameters()]}


def oom_at_one_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    model, acc = setup(FailAtCalls(limit=0 if rank == 1 else 10**9))
    auto = gradaccum.AutoBatch(acc, "auto", start=2)
    try:
        auto.step(shares(rank, world)[0][0], loss_of(model))
    except gradaccum.NoMicroBatchFitsError as error:
        return {"error_type": type(error).__name__, "message": str(error), "ooms": auto.ooms,
                "grads_none": all(p.grad is None for p in model.parameters())}
    return {"error_type": None}


def ranks_with_other_part_counts(rank: int, world: int) -> dict[str, Any]:
    model, acc = setup(FailAtCalls())
    x, y = shares(rank, world)[0][0]
    n = 12 if rank == 0 else 8  # 3 parts against 2 at micro-batch 4
    try:
        gradaccum.AutoBatch(acc, "auto", start=4).step((x[:n], y[:n]), loss_of(model))
    except ValueError as error:
        return {"message": str(error), "micro_step": acc.micro_step}
    return {"message": None}


def oom_in_a_synced_last_micro_batch(rank: int, world: int) -> dict[str, Any]:
    # Window 1 at 4 syncs nothing (calls 1-3); window 2 syncs in its last part: rank 1 runs out
    # there (call 6) while rank 0 waits in DDP's gradient all-reduce. Unrecoverable by design:
    # rank 1 raises; rank 0 fails once rank 1 leaves the group. Last scenario: it breaks the group.
    model, acc = setup(FailAtCalls(calls=(6,) if rank == 1 else ()))
    auto = gradaccum.AutoBatch(acc, "auto", start=4)
    start = time.monotonic()
    try:
        auto.run(shares(rank, world)[0][:2], loss_of(model))
    except RuntimeError as error:
        return {"error_type": type(error).__name__, "message": str(error),
                "cause": type(error.__cause__).__name__, "seconds": time.monotonic() - start}
    return {"error_type": None}


SCENARIOS = {"recovers_on_both_ranks": recovers_on_both_ranks,
             "oom_at_one_on_one_rank": oom_at_one_on_one_rank,
             "ranks_with_other_part_counts": ranks_with_other_part_counts,
             "oom_in_a_synced_last_micro_batch": oom_in_a_synced_last_micro_batch}


if __name__ == "__main__":
    # The last scenario leaves the default group broken on purpose.
    run_scenarios(SCENARIOS, timeout_s=60, broken=True)
