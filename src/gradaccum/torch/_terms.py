"""Loss terms with a normalizer of their own inside one window (``mb.backward(..., total=T)``).

A window has one normalizer: its micro-batch count (mean weighting) or its item total, which the
boundary divides by once (:mod:`gradaccum.core.window`). A loss whose terms have different
normalizers (a policy term per sequence, an entropy bonus per token, an auxiliary loss per
micro-batch) cannot share that one correction. A term whose window total ``T`` is known up front
(RL buffers its generation batch, so it knows each window's sequences and tokens) needs no
correction at all: it gets its exact weight in the window's gradient, ``n_i / T`` (a mean over
the micro-batch's ``n_i`` items) or ``1 / T`` (a sum), times the ranks ``W`` that DDP/FSDP2
average the gradients over (``T`` counts every rank's items). ``mb.term`` multiplies the term's
loss by that weight over the block's seed ``1 / N``, so terms and plain losses of one forward
are summed and backwarded once (two backward passes through a shared trunk would double its
cost).

That is exact only when the boundary multiplies by exactly 1, which holds for a *full* window of
mean weighting (``size / micro_step == 1``), the window kind of ``micro_batch()`` without
``n_items``. So a term needs such a block, and a window that holds one cannot be
flushed early (its totals would be the wrong ones); both are refused with a clear error. The
block's own losses (``mb.backward(loss)``) keep their weight ``1 / N``: a mean over the window's
micro-batches.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import torch

from gradaccum.torch._validate import check_items
from gradaccum.torch._weights import NO_FLOAT64, wide_count

__all__ = ["check_total", "term_count", "term_factor"]


def check_total(total: Any) -> Any:
    """Validate a term's window total: a number > 0 or a 0-dim tensor (its value not read).

    Raises:
        TypeError: not a number or a tensor.
        ValueError: 0, negative, NaN, inf, or a tensor of more than one element.
    """
    if isinstance(total, torch.Tensor):
        if total.numel() != 1 or total.dim() != 0 or total.is_complex() or total.dtype == torch.bool:
            raise ValueError(f"total must be a number > 0 or a 0-dim real tensor, got a tensor of "
                             f"shape {tuple(total.shape)} and dtype {total.dtype}")
        return total
    if isinstance(total, bool) or not isinstance(total, Real):
        raise TypeError(f"total must be a number > 0 or a 0-dim tensor, got {total!r}")
    value = int(total) if isinstance(total, Integral) else float(total)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"total must be a finite number > 0, got {total!r}")
    return value


def term_factor(n_items: Any, total: Any, reduction: Any, block_items: Any, world_size: int,
                size: int) -> Any:
    """The factor a term's loss is multiplied by, backwarded in a block whose seed is ``1 / size``:
    ``(n_items if "mean" else 1) * world_size * size / total`` (validated first).

    Args:
        n_items: the term's items in this micro-batch (required with ``reduction="mean"``).
        total: the term's total over the window (all micro-batches, all ranks).
        reduction: ``"mean"`` or ``"sum"``: how the term's loss is reduced over its items.
        block_items: the ``n_items`` the block was opened with (None: mean weighting).
        world_size: the ranks DDP/FSDP2 average the gradients over.
        size: the window's micro-batches ``N``.

    Returns:
        A Python number, or a float64 0-dim tensor (float32 where the device has no float64)
        when ``n_items`` or ``total`` is a tensor.

    Raises:
        TypeError, ValueError: a bad value, or ``block_items`` given (the block is item-weighted:
            its total is known only at the boundary, so no term beside it can be exact).

    Example:
        >>> term_factor(3, 12, "mean", None, 1, 4), term_factor(None, 10, "sum", None, 2, 5)
        (1.0, 1.0)
    """
    if block_items is not None:
        raise ValueError(f"mb.term(total={total!r}) needs a block opened without n_items "
                         f"(acc.micro_batch(), not acc.micro_batch({block_items!r})): that block's "
                         "item total is known only at the window's boundary, so a term with its own "
                         "total cannot be exact beside it; make the block's loss a term too")
    summed = reduction == "sum"
    if n_items is None and reduction == "mean":
        raise ValueError(f"mb.term(n_items=None, total={total!r}) with reduction='mean' needs n_items: "
                         "the term's items in this micro-batch, its loss being their mean")
    n = check_items(n_items if n_items is not None or not summed else 0, reduction)
    t = check_total(total)
    count = 1 if summed else n
    if not isinstance(count, torch.Tensor) and not isinstance(t, torch.Tensor):
        return count * world_size * size / t
    device = t.device if isinstance(t, torch.Tensor) else torch.as_tensor(count).device
    wide = torch.float32 if device.type in NO_FLOAT64 else torch.float64
    return torch.as_tensor(count, dtype=wide, device=device) * (world_size * size) / t


def term_count(value: Any) -> Any:
    """A term's count or total as the window records it: a number as it is, a tensor as a wide
    copy (the caller's may change later; counts of several kinds add up in float64)."""
    return wide_count(value.detach()) if isinstance(value, torch.Tensor) else value
