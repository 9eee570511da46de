"""The checker across ranks: the window on W DDP-wrapped gloo processes, each on its shard.

Rank ``r`` holds samples ``r * B/W`` to ``(r + 1) * B/W`` of the global batch of ``B`` and feeds
them as N micro-batches through ``Accumulator(..., model=ddp_model)``; every rank then returns
its parameters, its buffers and the parameters that received a gradient.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradaccum.torch.accumulator import Accumulator
from gradaccum.torch.check.losses import named_loss
from gradaccum.torch.check.runs import Run, micro_window
from gradaccum.torch.check.samples import Batch
from gradaccum.torch.check.spawn import check_picklable, run_on_ranks

__all__ = ["RankResult", "rank_windows"]


@dataclass
class RankResult:
    """One rank's state after the window.

    Attributes:
        params: the parameters by name (the model's own names, without DDP's ``module.``).
        buffers: the buffers by name.
        got_grad: the names of the parameters that received a gradient on this rank.
        run: its loss values and item counts.
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    got_grad: set[str] = field(default_factory=set)
    run: Run = field(default_factory=Run)


def rank_windows(base: nn.Module, batch: Batch, targets: torch.Tensor, loss: Any, steps: int,
                 world_size: int, weighted: bool, ddp_kwargs: Mapping[str, Any] | None = None,
                 timeout: float = 300.0) -> list[RankResult]:
    """Run the window on ``world_size`` gloo ranks (CPU), each on its contiguous shard.

    Raises:
        TypeError: the model or the loss cannot be pickled for the spawned processes.
        RankError: a rank raised or the ranks hung.
    """
    check_picklable("the model (its class)", base)
    check_picklable("loss", loss)
    payload = {"model": copy.deepcopy(base).cpu(), "batch": batch.to(torch.device("cpu")),
               "targets": targets.cpu(), "loss": loss, "steps": steps, "weighted": weighted,
               "ddp": dict(ddp_kwargs or {})}
    results: list[RankResult] = run_on_ranks(_window_on_rank, payload, world_size, timeout=timeout)
    return results


def _window_on_rank(rank: int, world: int, payload: dict[str, Any]) -> RankResult:
    """Rank side: DDP-wrap the model, run the window on this rank's shard, return the state."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(rank)  # each rank its own stream, as under torchrun
    model: nn.Module = payload["model"]
    model.train()
    batch: Batch = payload["batch"]
    share = batch.size // world
    shard = batch.part(rank * share, (rank + 1) * share)
    targets = payload["targets"][rank * share:(rank + 1) * share]
    got: set[str] = set()
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                lambda _p, _n=name: got.add(_n))
    ddp = DistributedDataParallel(model, **payload["ddp"])
    acc = Accumulator(torch.optim.SGD(ddp.parameters(), lr=1.0), payload["steps"], model=ddp)
    run = Run()
    micro_window(acc, ddp, shard, targets, named_loss(payload["loss"]), payload["steps"],
                 payload["weighted"], run)
    return RankResult({n: p.detach().clone() for n, p in model.named_parameters()},
                      {n: b.detach().clone() for n, b in model.named_buffers()}, got, run)
