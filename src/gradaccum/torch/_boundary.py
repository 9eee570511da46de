"""What happens at a window boundary, from the reduction across ranks to the optimizer step, and
the count arithmetic behind the provisional item total.

:func:`apply_window` is the accumulator's boundary without its bookkeeping: it reduces the
window's item total (and, across ranks, its loss sum), skips a summed window of no items,
unscales, normalizes and clips the gradients, and steps the optimizer unless the gradient is
non-finite. The accumulator then counts, steps the scheduler and clears the window whatever
happened (see ``Accumulator._apply``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.core.window import Window
from gradaccum.torch._grads import scale_and_clip_
from gradaccum.torch._precision import Precision
from gradaccum.torch._window_loss import WindowLoss, sum_losses
from gradaccum.torch.distributed.base import GradSync

__all__ = ["Outcome", "apply_window", "largest", "provisional_total"]


@dataclass(frozen=True)
class Outcome:
    """What a boundary did.

    Attributes:
        stepped: the optimizer stepped.
        loss: the window's loss record; None when the window held no items (keep the last one).
        most: the window's largest micro-batch count (across ranks: on any rank).
        grad_norm: the gradient's norm before clipping, when clipping or a check computed it.
        no_grads: no parameter of the optimizer had a gradient.
    """

    stepped: bool
    loss: WindowLoss | None = None
    most: Any = None
    grad_norm: torch.Tensor | None = None
    no_grads: bool = False


def largest(a: Any, b: Any) -> Any:
    """The larger of two counts (numbers or 0-dim tensors), with no host read; None is "none yet".

    Example:
        >>> largest(None, 3), largest(3, 5), largest(torch.tensor(4.0), 2)
        (3, 5, tensor(4.))
    """
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        t = a if isinstance(a, torch.Tensor) else b
        return torch.maximum(torch.as_tensor(a, dtype=t.dtype, device=t.device),
                             torch.as_tensor(b, dtype=t.dtype, device=t.device))
    return max(a, b)


def provisional_total(most: Any, size: int) -> Any:
    """The provisional item total ``P`` of a window: ``size`` times the largest count ``most``
    (1 where that is 0), with no host read.

    A Python count gives exactly ``size * most``, so a full window of equal counts is corrected by
    exactly 1 (no pass). A tensor count (corrected by a pass anyway) gives the power of two at or
    above it: each factor ``n_i / P`` is then exact in any float format, so a float32 loss of a
    float64 model is weighted as exactly as with an integer factor.

    Example:
        >>> provisional_total(3, 4), provisional_total(torch.tensor(3.0, dtype=torch.float64), 4)
        (12, tensor(16., dtype=torch.float64))
    """
    if isinstance(most, torch.Tensor):
        total = torch.where(most > 0, most, torch.ones_like(most)) * size
        mantissa, exponent = torch.frexp(total)  # total = mantissa * 2**exponent, mantissa in [0.5, 1)
        return torch.ldexp(torch.ones_like(total), exponent - (mantissa == 0.5).to(exponent.dtype))
    return (most if most > 0 else 1) * size


def apply_window(window: Window, losses: Sequence[torch.Tensor], most: Any, sync: GradSync,
                 precision: Precision, clip_norm: float | None) -> Outcome:
    """Reduce, normalize, clip and step for one complete (or flushed) window.

    Raises:
        RuntimeError: under DDP/FSDP2, no forward ran through the wrapped model this window.
        Whatever the scaler or the optimizer raises.
    """
    sync.check_forward()
    distributed = sync.world_size > 1
    items = window.items if window.weighting == "items" else None
    loss_sum, items, reduced = sync.reduce_window(sum_losses(losses) if distributed else None, items,
                                                  most if distributed else None)
    if distributed:
        most = reduced
    # A summed window may hold no items at all: its total is read once (a host read for a tensor).
    if window.summed and not bool(items > 0):
        return Outcome(False, most=most)
    factor = window.grad_factor(items)
    loss = WindowLoss((loss_sum,) if distributed else tuple(losses), factor)
    grads = precision.window_grads()
    norm = scale_and_clip_(grads, factor, clip_norm)
    stepped, norm = precision.step(grads, norm)
    return Outcome(stepped, loss, most, norm, no_grads=not grads)
