"""Rank side of tests/distributed/test_pipeline.py's 4-process launch: 4 stages, and PP x DP 2 x 2
(DDP and FSDP2 stage modules), as tests/distributed/pipeline_ranks.py runs 2."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from gradaccum.bench.pipeline import window_batches
from tests.distributed.pipeline_ranks import (
    SEQS,
    STEPS,
    Pipe,
    attempt,
    checkpoint,
    discard_call,
    flush_partial,
    inf_in_window,
    train,
)
from tests.ranks import run_scenarios


def counted(pipe: Pipe, loop: Any) -> list[dict[str, int]]:
    """Per call of ``loop(tokens, labels)``: the all-reduces through ``dist.all_reduce`` (the
    accumulator's, or a hand loop's), DDP's gradient all-reduces (its comm hook: one per bucket) and
    FSDP2's reduce-scatters."""
    seen = {"all_reduce": 0, "reduce_scatter": 0}
    ddp = {"calls": 0}
    if pipe.mods and hasattr(pipe.mods[0], "register_comm_hook"):
        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
            ddp["calls"] += 1
            seen["all_reduce"] -= 1  # the hook's own dist.all_reduce: DDP's, not the accumulator's
            return allreduce_hook(state, bucket)

        pipe.mods[0].register_comm_hook(pipe.mods[0].process_group, hook)
    real_ar, real_rs = dist.all_reduce, dist.reduce_scatter_single  # FSDP2 calls the latter

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        seen["all_reduce"] += 1
        return real_ar(*args, **kwargs)

    def reduce_scatter(*args: Any, **kwargs: Any) -> Any:
        seen["reduce_scatter"] += 1
        return real_rs(*args, **kwargs)

    dist.all_reduce, dist.reduce_scatter_single = all_reduce, reduce_scatter
    events = []
    try:
        for w in range(3):
            for tokens, labels in window_batches(w, STEPS, pipe.replicas, SEQS)[pipe.dp_rank]:
                before = (seen["all_reduce"], ddp["calls"], seen["reduce_scatter"])
                loop(tokens, labels)
                events.append({"own": seen["all_reduce"] - before[0], "ddp": ddp["calls"] - before[1],
                               "reduce_scatter": seen["reduce_scatter"] - before[2]})
    finally:
        dist.all_reduce, dist.reduce_scatter_single = real_ar, real_rs
    return events


def collectives(rank: int, world: int, dp: str) -> dict[str, Any]:
    """Per call: gradaccum's pipeline, then the schedule stepped by hand (its own data-parallel
    reduction in every step())."""
    pipe = Pipe(world, pp=2, dp=dp)
    mine = counted(pipe, pipe.feed)
    hand = Pipe(world, pp=2, dp=dp, layout_=(pipe.pp_group, pipe.dp_mesh, pipe.pp_rank, pipe.dp_rank))

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> None:
        hand.schedule.step(*((tokens,) if hand.first else ()), target=labels if hand.last else None)

    return {"gradaccum": mine, "schedule": counted(hand, step)}


def uneven_replicas(rank: int, world: int) -> dict[str, Any]:
    """Replica 0 feeds 2 calls then flushes, replica 1 one call (a window of 3): without any
    per-call agreement, flush()'s agreement makes every rank raise."""
    pipe = Pipe(world, pp=2, dp="ddp")
    batches = window_batches(0, STEPS, 2, SEQS)[pipe.dp_rank]
    n = 2 if pipe.dp_rank == 0 else 1
    calls = [lambda i=i: pipe.feed(*batches[i]) for i in range(n)]
    return attempt(pipe, [*calls, pipe.acc.flush])


if __name__ == "__main__":
    run_scenarios({
        "gpipe4 sum clip": lambda r, w: train(r, w, "gpipe"),
        "1f1b4 mean": lambda r, w: train(r, w, "1f1b", reduction="mean", clip=None),
        "interleaved4 mean clip": lambda r, w: train(r, w, "interleaved", virtual=2, reduction="mean"),
        "ppdp ddp 1f1b sum clip": lambda r, w: train(r, w, "1f1b", pp=2, dp="ddp"),
        "ppdp ddp gpipe mean": lambda r, w: train(r, w, "gpipe", pp=2, dp="ddp", reduction="mean", clip=None),
        "ppdp ddp interleaved sum clip": lambda r, w: train(r, w, "interleaved", pp=2, virtual=2, dp="ddp"),
        "ppdp fsdp 1f1b sum clip": lambda r, w: train(r, w, "1f1b", pp=2, dp="fsdp"),
        "ppdp fsdp interleaved sum clip": lambda r, w: train(r, w, "interleaved", pp=2, virtual=2, dp="fsdp"),
        "ppdp fsdp gpipe mean": lambda r, w: train(r, w, "gpipe", pp=2, dp="fsdp", reduction="mean",
                                                   clip=None),
        "ppdp ddp scaler inf on rank 2": lambda r, w: inf_in_window(
            r, w, 2, pp=2, dp="ddp", scaler=torch.amp.GradScaler("cpu")),
        "ppdp ddp checkpoint": lambda r, w: checkpoint(r, w, "sum", pp=2, dp="ddp"),
        "ppdp fsdp checkpoint micro_batch": lambda r, w: checkpoint(r, w, "mean", pp=2, dp="fsdp",
                                                                    sync="micro_batch"),
        "ppdp ddp flush": lambda r, w: flush_partial(r, w, pp=2, dp="ddp"),
        "ppdp fsdp flush": lambda r, w: flush_partial(r, w, pp=2, dp="fsdp"),
        "ppdp fsdp discard": lambda r, w: discard_call(r, w, pp=2, dp="fsdp"),
        "collectives ddp": lambda r, w: collectives(r, w, "ddp"),
        "collectives fsdp": lambda r, w: collectives(r, w, "fsdp"),
        "uneven replicas": uneven_replicas,
    })
