"""The seed experiment on several processes: torchrun's environment, DDP, a DistributedSampler.

``torchrun --nproc-per-node 2 -m gradaccum train ...`` starts one process per rank with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. Each rank
joins the process group (gloo on CPU, NCCL on CUDA), wraps the model in DDP and trains on its
DistributedSampler share; the Accumulator syncs once per window. Outside torchrun all of this
reduces to one process, unchanged.

The sampler uses the one-process trainer's permutation, and rank ``r`` holds its items
``r, r + W, r + 2W, ...``: micro-batch ``i`` of all ranks together is micro-batch ``i`` of a
one-process run with W times the micro-batch, so ``W`` ranks x micro-batch ``m`` x ``N`` steps
make the very windows of one process with micro-batch ``W*m`` x ``N`` steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Log", "Ranks", "current_ranks", "epoch_order", "init_from_env", "rank_log", "wrap"]

Log = Callable[[str], None]


@dataclass(frozen=True)
class Ranks:
    """Where this process stands: its rank, the number of ranks, its local rank (GPU index).

    Example:
        >>> Ranks().main, Ranks(rank=1, world=2).main
        (True, False)
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """True on the rank that prints and writes outputs (rank 0)."""
        return self.rank == 0


def current_ranks() -> Ranks:
    """The ranks of the initialized default process group (one process when there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Ranks()
    return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def init_from_env(device: str) -> Ranks:
    """Join the process group torchrun's environment describes; one process without it.

    Args:
        device: the training device; ``cuda`` selects NCCL and this rank's GPU (``LOCAL_RANK``),
            anything else gloo.

    Returns:
        This process's :class:`Ranks`.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return current_ranks()
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    return current_ranks()


def wrap(model: nn.Module, ranks: Ranks, device: torch.device) -> nn.Module:
    """``model`` in ``DistributedDataParallel`` on several ranks; ``model`` itself on one."""
    if ranks.world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[ranks.local_rank] if device.type == "cuda" else None)


def epoch_order(n: int, seed: int, epoch: int, ranks: Ranks) -> torch.Tensor:
    """This rank's item indices for one epoch, in training order.

    One process: a permutation of ``range(n)`` seeded by ``seed * 1000 + epoch``. Several: a
    ``DistributedSampler`` seeded so that it draws that same permutation, then takes every
    ``world``-th item from ``rank`` (padding by repetition when ``world`` does not divide ``n``).

    Example:
        >>> full = epoch_order(6, 0, 1, Ranks())
        >>> torch.equal(epoch_order(6, 0, 1, Ranks(1, 2)), full[1::2])
        True
    """
    if ranks.world == 1:
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    from torch.utils.data import DistributedSampler

    items: list[int] = list(range(n))  # a Sized "dataset": the sampler only needs its length
    sampler: DistributedSampler[int] = DistributedSampler(
        items, num_replicas=ranks.world, rank=ranks.rank, shuffle=True, seed=seed * 1000)  # type: ignore[arg-type]
    sampler.set_epoch(epoch)  # DistributedSampler seeds its permutation with seed + epoch
    return torch.tensor(list(sampler), dtype=torch.int64)


def rank_log(log: Log, ranks: Ranks) -> Log:
    """``log`` on rank 0, a no-op on the others: rank 0 prints for all (they agree on every line).

    Example:
        >>> rank_log(print, Ranks()) is print, rank_log(print, Ranks(rank=1, world=2)) is print
        (True, False)
    """
    return log if ranks.main else _drop


def _drop(line: str) -> None:
    """Drop a line."""
