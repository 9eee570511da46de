"""Data parallel for the MindSpore accumulator: one all-reduce per window, counters included.

Under ``msrun`` (or any launcher after ``mindspore.communication.init()``) every rank feeds its
own micro-batches and the accumulator sums the window over the ranks once, at the boundary,
before normalizing and clipping. The gradient buffers and the window's counters (micro-batches,
items, loss sum, micro-batches that gave a loss) travel in one flat all-reduce, so the item
total is exact over all ranks and the window is normalized by it, not by a per-rank count.

The item total is split in two float parts (``items // 4096`` and ``items % 4096``) so that the
float32 sum stays an exact integer up to 2**36 items per window on up to 4096 ranks.

``flush()`` first agrees on the window's length on the host (:func:`agree_on_length`, one
all-gather of one number per rank), so that partial windows of different lengths raise on every
rank before the graph runs; and with ``average_batchnorm=`` the BatchNorm running statistics
ride in the window's all-reduce too, and come back as their mean over the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops

__all__ = ["ITEM_BASE", "WindowReduce", "agree_on_length", "batchnorm_statistics", "data_parallel_world"]

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


def agree_on_length(micro_step: int) -> int:
    """The length of the partial window every rank holds, agreed on the host before ``flush()``'s graph.

    One all-gather of one float32 per rank (MindSpore's CPU all-reduce only sums, so the
    shortest and longest window come from the gathered values); every rank sees the same values,
    so every rank returns or every rank raises, and none is left waiting in a collective.

    Args:
        micro_step: the micro-batches this rank's open window holds.

    Returns:
        That length, the same on every rank (0: every window is empty).

    Raises:
        ValueError: the ranks hold partial windows of different lengths (the message names the
            shortest and the longest).

    Example:
        Under msrun, on every rank, before the flush's graph::

            if agree_on_length(acc.micro_step) == 0:
                ...  # nothing to apply anywhere
    """
    gathered = ops.AllGather()(Tensor(np.array([micro_step], np.float32))).asnumpy()
    shortest, longest = int(gathered.min()), int(gathered.max())
    if shortest != longest:
        raise ValueError(
            f"flush(): the ranks hold partial windows of different lengths (from {shortest} to "
            f"{longest} micro-batches); every rank must feed the same number of micro-batches per "
            "window (give every rank the same number of batches, e.g. drop the last uneven ones)")
    return longest


def batchnorm_statistics(model: Any) -> tuple[Parameter, ...]:
    """The running statistics of ``model``'s BatchNorm layers (every ``moving_mean`` and
    ``moving_variance`` Parameter), to average over the ranks at each boundary.

    Args:
        model: a ``mindspore.nn.Cell``.

    Returns:
        The Parameters, in the model's order.

    Raises:
        TypeError: ``model`` is not a Cell.
        ValueError: ``model`` has no BatchNorm running statistics.

    Example:
        >>> from mindspore import nn
        >>> [p.name for p in batchnorm_statistics(nn.SequentialCell([nn.BatchNorm1d(2)]))]
        ['0.moving_mean', '0.moving_variance']
    """
    from mindspore import nn

    if not isinstance(model, nn.Cell):
        raise TypeError(f"average_batchnorm must be a mindspore.nn.Cell, got {type(model).__name__}")
    stats = tuple(p for name, p in model.parameters_and_names()
                  if name.rsplit(".", 1)[-1] in ("moving_mean", "moving_variance"))
    if not stats:
        raise ValueError(f"average_batchnorm={type(model).__name__}: the model has no BatchNorm running "
                         "statistics (no moving_mean or moving_variance Parameter)")
    return stats


def _flat(dtype: Any, buf: Tensor) -> Tensor:
    return buf.reshape(-1).astype(dtype)


def _put(buf: Tensor, piece: Tensor) -> Tensor:
    return ops.assign(buf, piece.reshape(buf.shape).astype(buf.dtype))


def _put_mean(world: int, buf: Tensor, piece: Tensor) -> Tensor:
    return ops.assign(buf, (piece / world).reshape(buf.shape).astype(buf.dtype))


@ms.jit_class
class WindowReduce:
    """Sum the window's buffers and counters over the ranks in one all-reduce, in place.

    Args:
        buffers: the accumulator's gradient buffers (their shapes fix the split).
        world: the number of ranks (the collective spans the world group).
        stats: Parameters to replace by their mean over the ranks in the same all-reduce (the
            BatchNorm running statistics of ``average_batchnorm=``); none by default.

    Example:
        Built by the accumulator under data parallel only::

            reduce = WindowReduce(acc_buffers, world=2)
            totals = reduce(acc_buffers, counters, True)  # inside the boundary's graph branch
    """

    def __init__(self, buffers: Sequence[Parameter], world: int, stats: Sequence[Parameter] = ()) -> None:
        self.world = world
        wide = any(b.dtype == ms.float64 for b in buffers)
        self.dtype = ms.float64 if wide else ms.float32  # never below float32: exact counters
        self.sizes = tuple(int(np.prod(b.shape)) for b in buffers)
        self.stats = ms.ParameterTuple(stats)
        self.n_stats = len(stats)
        self.stat_sizes = tuple(int(np.prod(p.shape)) for p in stats)
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM)
        self._map = ops.HyperMap()

    def __call__(self, buffers: Sequence[Parameter], counters: Tensor, held: Tensor) -> Tensor:
        """Replace every buffer by its sum over the ranks (and every statistic by its mean);
        return the summed ``counters``.

        Args:
            buffers: the gradient buffers.
            counters: a 1-D float tensor of the window's counters on this rank.
            held: a bool scalar, False when this rank's window is empty: its buffers (the last
                window's values) then count as zeros.
        """
        flat = ops.concat(self._map(ops.partial(_flat, self.dtype), buffers))
        flat = ops.select(held.broadcast_to(flat.shape), flat, ops.zeros_like(flat))
        if self.n_stats > 0:  # a constant: the graph without statistics has no branch
            flat = ops.concat((flat, ops.concat(self._map(ops.partial(_flat, self.dtype), self.stats))))
        # One collective per window: the statistics and the counters ride after the gradients.
        total = self.all_reduce(ops.concat((flat, counters.astype(self.dtype))))
        pieces = ops.split(total, (*self.sizes, *self.stat_sizes, counters.shape[0]))
        n = len(self.sizes)
        done = self._map(_put, buffers, pieces[:n])
        if self.n_stats > 0:
            done = ops.depend(done, self._map(ops.partial(_put_mean, self.world), self.stats, pieces[n:-1]))
        return ops.depend(pieces[-1], done)
