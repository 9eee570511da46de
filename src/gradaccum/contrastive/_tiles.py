"""What the tiled kernels share: the rows this process computes, the tiles, their dtype, and the
gradient buffer the ranks sum in one all-reduce.

A kernel walks the ``tile x tile`` blocks of ``scale * a @ b.T`` over its share of the rows of ``a``
and every row of ``b``; it never holds more than a few blocks at once. On one process the share is
every row. While ``loss_fn`` of ``Accumulator.backward_cached`` runs on several ranks, every rank
holds the same gathered inputs (``gradaccum.torch._reps.loss_ranks``), so the rows are shared out
evenly: each rank computes its block of rows against every column, and the ranks sum their parts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradaccum.torch._reps import loss_ranks
from gradaccum.torch.distributed.collectives import RankGroups

__all__ = ["CPU_TILE", "CUDA_TILE", "Grads", "Share", "accumulate", "logits", "no_autocast", "pick_tile",
           "refuse_double_backward", "spans", "work_dtype"]

CPU_TILE = 1024  # 4 MiB per float32 block
CUDA_TILE = 4096  # 64 MiB per float32 block: large enough to keep a GPU busy


def pick_tile(device: torch.device) -> int:
    """The tile for ``tile=None``: :data:`CPU_TILE` rows and columns, :data:`CUDA_TILE` on a GPU."""
    return CUDA_TILE if device.type == "cuda" else CPU_TILE


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the blocks' exponentials and of every sum: float32 for 16-bit inputs, else
    the inputs' own (float32 or float64)."""
    return torch.float32 if dtype.itemsize < 4 else dtype


@dataclass(frozen=True)
class Share:
    """The rows ``lo:hi`` this process computes, and the ranks that compute the others.

    Attributes:
        lo, hi: this process's rows (all of them on one process).
        ranks: the ranks that share the rows (None: one process).
    """

    lo: int
    hi: int
    ranks: RankGroups | None

    @classmethod
    def of(cls, rows: int) -> Share:
        """This process's even share of ``rows`` rows (all of them outside a ranked loss)."""
        ranks = loss_ranks()
        if ranks is None:
            return cls(0, rows, None)
        rank, world = ranks.rank, ranks.world_size
        return cls(rows * rank // world, rows * (rank + 1) // world, ranks)

    def sum_(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks in place (nothing on one process)."""
        if self.ranks is not None:
            self.ranks.all_reduce(tensor)

    def max_(self, tensor: torch.Tensor) -> None:
        """The element-wise maximum of ``tensor`` over the ranks, in place."""
        if self.ranks is not None:
            self.ranks.all_reduce(tensor, op=dist.ReduceOp.MAX)


def spans(lo: int, hi: int, tile: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of each block of at most ``tile`` rows of ``lo:hi``."""
    for start in range(lo, hi, tile):
        yield start, min(start + tile, hi)


def logits(ai: torch.Tensor, bj: torch.Tensor, scale: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    """One block ``scale * ai @ bj.T``: the product in the inputs' dtype, the result in ``work``."""
    block = torch.mm(ai, bj.T)
    return (block if block.dtype == work else block.to(work)).mul_(scale)


def accumulate(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """``out += x @ y`` in place (the product in ``x``'s dtype, summed in ``out``'s)."""
    if out.dtype == x.dtype:
        out.addmm_(x, y)
    else:
        out.add_(torch.mm(x, y))


class Grads:
    """The gradients of ``a`` (``rows x d``), ``b`` (``cols x d``) and ``scalars`` scalars, views
    of one flat buffer in the work dtype: the ranks sum it in a single all-reduce.

    Attributes:
        a, b: the two matrices' gradients (before the scale's factor).
        scalars: the scalars' gradients.
    """

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scalars: int, work: torch.dtype) -> None:
        (rows, d), cols = a.shape, len(b)
        self.flat = torch.zeros(rows * d + cols * d + scalars, dtype=work, device=a.device)
        self.a = self.flat[:rows * d].view(rows, d)
        self.b = self.flat[rows * d:(rows + cols) * d].view(cols, d)
        self.scalars = self.flat[(rows + cols) * d:]


def no_autocast(device: torch.device) -> Any:
    """A block in which autocast is off on ``device``: the kernels pick their own dtypes."""
    kind = device.type
    if torch.amp.is_autocast_available(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


def refuse_double_backward(name: str) -> None:
    """Raise when the backward pass runs with ``create_graph=True`` (grad mode on inside it).

    Raises:
        RuntimeError: always, when grad mode is on.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(f"{name}: the tiled losses do not support double backward (create_graph=True, "
                           "torch.autograd.grad of a gradient); compute this loss densely where you need "
                           "second derivatives")
