"""The rank side of check 8: one DDP rank over gloo (:func:`rank_main`, forked by the check).

Every rank builds the same float64 GPT and the same global batches from seeds, trains its share
through ``DistributedDataParallel`` and an ``Accumulator`` (one bucket, so one gradient sync is
one all-reduce), counts the gradient all-reduces (a DDP comm hook) and the Accumulator's own
(``torch.distributed.all_reduce``, wrapped), and trains the one-process reference on the whole
global batch itself. Writes ``OUT/rank{r}.json``, and its output to ``OUT/rank{r}.log``. On CUDA
every rank uses GPU 0: gloo, unlike NCCL, lets two processes share one GPU.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator
from gradaccum.bench.gpu.gpt import GPT_TINY, IGNORE, gpt_loss, token_batches
from gradaccum.demos.gpt import GPT

__all__ = ["STEPS", "WINDOWS", "rank_main", "scenario"]

STEPS, WINDOWS, MICRO = 3, 3, 2


@contextmanager
def _counting(ddp: DDP) -> Iterator[dict[str, int]]:
    """Count DDP's gradient all-reduces (one comm-hook call per bucket) and the other all-reduces
    (``torch.distributed.all_reduce``, wrapped while the block runs)."""
    count = {"grad": 0, "other": 0}

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        count["grad"] += 1
        return allreduce_hook(state, bucket)

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        count["other"] += 1
        return plain(*args, **kwargs)

    ddp.register_comm_hook(None, hook)
    plain = dist.all_reduce
    dist.all_reduce = all_reduce
    try:
        yield count
    finally:
        dist.all_reduce = plain


def scenario(device: torch.device, weighting: str) -> dict[str, Any]:
    """Train WINDOWS windows on this rank and the one-process reference; counts and differences."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPT_TINY).to(device=device, dtype=torch.float64)
    reference = copy.deepcopy(model)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=1024)
    acc = Accumulator(torch.optim.SGD(ddp.parameters(), lr=0.1), STEPS, model=ddp)
    ref_acc = Accumulator(torch.optim.SGD(reference.parameters(), lr=0.1), world * STEPS, sync="local")
    calls: list[list[int]] = []
    losses, ref_losses = [], []
    with _counting(ddp) as count:
        for w in range(WINDOWS):
            batches = token_batches(GPT_TINY, MICRO, world * STEPS, device, seed=100 + w, padded=True)
            for i, (x, y) in enumerate(batches):  # the reference: every rank's micro-batches
                n = (y != IGNORE).sum() if weighting == "n_items" else None
                ref_acc.backward(gpt_loss(reference(x)[0], y), n_items=n)
                if rank * STEPS <= i < (rank + 1) * STEPS:
                    acc.backward(gpt_loss(ddp(x)[0], y), n_items=n)
                    # the comm hook's all-reduce goes through dist.all_reduce too
                    calls.append([count["grad"], count["other"] - count["grad"]])
            losses.append(float(acc.window_loss))  # type: ignore[arg-type]
            ref_losses.append(float(ref_acc.window_loss))  # type: ignore[arg-type]
    diff = max(float((a - b).abs().max())
               for a, b in zip(ddp.module.parameters(), reference.parameters(), strict=True))
    return {"calls": calls, "max_abs_param_diff": diff, "window_losses": losses,
            "reference_losses": ref_losses, "optimizer_steps": acc.optimizer_steps}


def rank_main(out: Path, device_type: str, rank: int, world: int, port: int) -> None:
    """Join the gloo group on 127.0.0.1:``port``, run both weightings, write the results."""
    fd = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    results = {weighting: scenario(device, weighting) for weighting in ("mean", "n_items")}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
