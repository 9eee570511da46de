"""Data parallel for the MindSpore accumulator: one all-reduce per window, counters included.

Under ``msrun`` (or any launcher after ``mindspore.communication.init()``) every rank feeds its
own micro-batches and the accumulator sums the window over the ranks once, at the boundary,
before normalizing and clipping. The gradient buffers and the window's counters (micro-batches,
items, loss sum, micro-batches that gave a loss) travel in one flat all-reduce, so the item
total is exact over all ranks and the window is normalized by it, not by a per-rank count.

The item total is split in two float parts (``items // 4096`` and ``items % 4096``) so that the
float32 sum stays an exact integer up to 2**36 items per window on up to 4096 ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops

__all__ = ["ITEM_BASE", "WindowReduce", "data_parallel_world"]

ITEM_BASE = 4096  # the item total travels as (items // ITEM_BASE, items % ITEM_BASE)


def data_parallel_world(data_parallel: Any) -> int:
    """The number of ranks the accumulator reduces over.

    Args:
        data_parallel: ``None`` (default): every rank of ``mindspore.communication``'s world
            group once ``init()`` has run, else 1; ``True``: the same, but ``init()`` must have
            run; ``False``: 1 (the caller reduces the gradients itself).

    Returns:
        The world size (1: no reduction).

    Raises:
        TypeError: ``data_parallel`` is not None or a bool.
        ValueError: ``data_parallel=True`` before ``mindspore.communication.init()``.

    Example:
        >>> data_parallel_world(None)  # no init(): one process
        1
    """
    if data_parallel is not None and not isinstance(data_parallel, bool):
        raise TypeError(f"data_parallel must be None, True or False, got {data_parallel!r}")
    if data_parallel is False:
        return 1
    from mindspore.communication import GlobalComm, get_group_size

    if not GlobalComm.INITED:
        if data_parallel:
            raise ValueError("data_parallel=True needs mindspore.communication.init() first "
                             "(run under msrun, see docs/MINDSPORE.md)")
        return 1
    return int(get_group_size())


def _flat(dtype: Any, buf: Tensor) -> Tensor:
    return buf.reshape(-1).astype(dtype)


def _put(buf: Tensor, piece: Tensor) -> Tensor:
    return ops.assign(buf, piece.reshape(buf.shape).astype(buf.dtype))


@ms.jit_class
class WindowReduce:
    """Sum the window's buffers and counters over the ranks in one all-reduce, in place.

    Args:
        buffers: the accumulator's gradient buffers (their shapes fix the split).
        world: the number of ranks (the collective spans the world group).

    Example:
        Built by the accumulator under data parallel only::

            reduce = WindowReduce(acc_buffers, world=2)
            totals = reduce(acc_buffers, counters, True)  # inside the boundary's graph branch
    """

    def __init__(self, buffers: Sequence[Parameter], world: int) -> None:
        self.world = world
        wide = any(b.dtype == ms.float64 for b in buffers)
        self.dtype = ms.float64 if wide else ms.float32  # never below float32: exact counters
        self.sizes = tuple(int(np.prod(b.shape)) for b in buffers)
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM)
        self._map = ops.HyperMap()

    def __call__(self, buffers: Sequence[Parameter], counters: Tensor, held: Tensor) -> Tensor:
        """Replace every buffer by its sum over the ranks; return the summed ``counters``.

        Args:
            buffers: the gradient buffers.
            counters: a 1-D float tensor of the window's counters on this rank.
            held: a bool scalar, False when this rank's window is empty: its buffers (the last
                window's values) then count as zeros.
        """
        flat = ops.concat(self._map(ops.partial(_flat, self.dtype), buffers))
        flat = ops.select(held.broadcast_to(flat.shape), flat, ops.zeros_like(flat))
        # One collective per window: the counters ride at the end of the gradients.
        total = self.all_reduce(ops.concat((flat, counters.astype(self.dtype))))
        pieces = ops.split(total, (*self.sizes, counters.shape[0]))
        done = self._map(_put, buffers, pieces[:-1])
        return ops.depend(pieces[-1], done)
