"""What the tiled kernels share: the rows this process computes, the tiles, their dtypes, and the
gradient buffer the ranks sum in one all-reduce.

A kernel walks the ``tile x tile`` blocks of ``scale * a @ b.T`` over its share of the rows of ``a``
and every row of ``b``; it never holds more than a few blocks at once. On one process the share is
every row. While ``loss_fn`` of ``Accumulator.backward_cached`` runs on several ranks, every rank
holds the same gathered inputs (``gradaccum.torch.cached.loss_ranks``), so the rows are shared out
evenly: each rank computes its block of rows against every column, and the ranks sum their parts.

Dtypes (:class:`Plan`): the blocks' matrix products run in the inputs' dtype, or, under autocast,
in autocast's dtype for float32 inputs (as the dense ``a @ b.T`` would); their exponentials and
every sum run in float32 at least (float64 inputs stay float64). Autocast itself is off inside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradaccum.torch.cached.loss_ranks import loss_ranks
from gradaccum.torch.distributed.collectives import RankGroups

__all__ = ["CPU_TILE", "CUDA_TILE", "Grads", "Plan", "Share", "accumulate", "gemm_dtype", "logits",
           "no_autocast", "pick_tile", "refuse_double_backward", "spans", "work_dtype"]

CPU_TILE = 1024  # 4 MiB per float32 block
CUDA_TILE = 8192  # 256 MiB per float32 block: each block's work outweighs launching its kernels


def pick_tile(device: torch.device) -> int:
    """The tile for ``tile=None``: :data:`CPU_TILE` rows and columns, :data:`CUDA_TILE` on a GPU."""
    return CUDA_TILE if device.type == "cuda" else CPU_TILE


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the blocks' exponentials and of every sum: float32 for 16-bit products, else
    the products' own (float32 or float64)."""
    return torch.float32 if dtype.itemsize < 4 else dtype


def gemm_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype of the blocks' products: autocast's for float32 inputs under autocast on their
    device (as autocast runs ``a @ b.T``), else the inputs' own."""
    kind = t.device.type
    if t.dtype == torch.float32 and torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return t.dtype


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


@dataclass(frozen=True)
class Plan:
    """How a kernel walks its blocks.

    Attributes:
        tile: the rows and columns of one block.
        share: this process's rows.
        gemm: the dtype of the blocks' products (:func:`gemm_dtype`).
    """

    tile: int
    share: Share
    gemm: torch.dtype

    @property
    def work(self) -> torch.dtype:
        """The dtype of the exponentials and of every sum (:func:`work_dtype`)."""
        return work_dtype(self.gemm)

    def rows(self) -> Iterator[tuple[int, int]]:
        """Each block of this process's rows."""
        return spans(self.share.lo, self.share.hi, self.tile)

    def columns(self, count: int) -> Iterator[tuple[int, int]]:
        """Each block of ``count`` columns."""
        return spans(0, count, self.tile)


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

    def scale_dot(self, a: torch.Tensor, share: Share) -> None:
        """Put ``sum_i a_i . (dS @ b)_i`` over this process's rows (the scale's gradient, ``dS``
        the blocks' gradients) into ``scalars[0]``."""
        own = slice(share.lo, share.hi)
        self.scalars[0] = torch.dot(a[own].reshape(-1).to(self.a.dtype), self.a[own].reshape(-1))

    def results(self, a: torch.Tensor, b: torch.Tensor, scalars: tuple[torch.Tensor, ...],
                scale: torch.Tensor, need: tuple[bool, ...]) -> list[torch.Tensor | None]:
        """The gradients of ``a``, ``b`` and ``scalars`` in their own dtypes and shapes (None where
        ``need`` says none is needed); those of ``a`` and ``b`` multiplied by ``scale``."""
        out: list[torch.Tensor | None] = [
            self.a.mul_(scale).to(a.dtype) if need[0] else None,
            self.b.mul_(scale).to(b.dtype) if need[1] else None]
        for k, t in enumerate(scalars):
            out.append(self.scalars[k].to(t.dtype).reshape(t.shape) if need[2 + k] else None)
        return out


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
