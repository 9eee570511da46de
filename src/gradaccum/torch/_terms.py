"""Loss terms with a normalizer of their own inside one window (``mb.backward(..., total=T)``).

A window has one normalizer: its micro-batch count (mean weighting) or its item total, which the
boundary divides by once (:mod:`gradaccum.core.window`). A loss whose terms have different
normalizers (a policy term per sequence, an entropy bonus per token, an auxiliary loss per
micro-batch) cannot share that one correction. A term whose window total ``T`` is known up front
(RL buffers its generation batch, so it knows each window's sequences and tokens) needs no
correction at all: its backward is seeded with its exact weight in the window's gradient,
``n_i / T`` (a mean over the micro-batch's ``n_i`` items) or ``1 / T`` (a sum), times the ranks
``W`` that DDP/FSDP2 average the gradients over (``T`` counts every rank's items).

That is exact only when the boundary multiplies by exactly 1, which holds for a *full* window of
mean weighting (``size / micro_step == 1``), the window kind of ``micro_batch()`` without
``n_items``. So a term with a total needs such a block, and a window that holds one cannot be
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

__all__ = ["check_term", "term_seed", "term_weight"]


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


def check_term(n_items: Any, total: Any, reduction: Any, block_items: Any) -> tuple[Any, Any, bool]:
    """Validate one ``mb.backward`` call's own weighting, before its backward runs.

    Args:
        n_items: the term's items in this micro-batch (required with ``reduction="mean"``).
        total: the term's total over the window (all micro-batches, all ranks), or None for a
            loss weighted like the block.
        reduction: ``"mean"`` or ``"sum"``: how the term's loss is reduced over its items.
        block_items: the ``n_items`` the block was opened with (None: mean weighting).

    Returns:
        ``(n_items, total, summed)`` checked; ``total`` None means "weighted like the block".

    Raises:
        TypeError, ValueError: a bad value; ``n_items`` or ``reduction="sum"`` without
            ``total``; ``total`` in a block opened with ``n_items``.
    """
    if total is None:
        if n_items is not None or reduction != "mean":
            raise ValueError(f"mb.backward(n_items={n_items!r}, reduction={reduction!r}) needs total=: "
                             "the term's total over the window (a loss without them is weighted "
                             "like the block)")
        return None, None, False
    if block_items is not None:
        raise ValueError(f"mb.backward(total={total!r}) needs a block opened without n_items "
                         f"(acc.micro_batch(), not acc.micro_batch({block_items!r})): the "
                         "window's item total is known only at its boundary, so a term with its own "
                         "total cannot be exact beside it; give that term n_items= and total= too")
    n = check_items(n_items, reduction)
    return n, check_total(total), reduction == "sum"


def term_seed(loss: torch.Tensor, n: Any, total: Any, summed: bool, world_size: int) -> torch.Tensor:
    """The gradient a term's backward starts from: ``(1 if summed else n) * world_size / total``.

    Example:
        >>> term_seed(torch.tensor(2.0, dtype=torch.float64), 3, 12, False, 1)
        tensor(0.2500, dtype=torch.float64)
    """
    count = 1 if summed else n
    if not isinstance(count, torch.Tensor) and not isinstance(total, torch.Tensor):
        return torch.full(loss.shape, count * world_size / total, dtype=loss.dtype, device=loss.device)
    wide = torch.float64 if loss.device.type != "mps" else torch.float32
    seed: torch.Tensor = torch.as_tensor(count, dtype=wide, device=loss.device) * world_size / total
    return seed.to(loss.dtype).reshape(loss.shape)


def term_weight(n: Any, total: Any, summed: bool, world_size: int, size: int) -> Any:
    """The term's weight in the window's loss ``sum(loss * weight) / size`` (a full window)."""
    count = 1 if summed else n
    return count * world_size * size / total
