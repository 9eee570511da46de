"""What happens at a window boundary, from the reduction across ranks to the optimizer step.

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
from gradaccum.torch._state import is_nonzero
from gradaccum.torch._window_loss import WindowLoss
from gradaccum.torch.distributed.base import GradSync

__all__ = ["Outcome", "apply_window", "sum_losses"]


@dataclass(frozen=True)
class Outcome:
    """What a boundary did.

    Attributes:
        stepped: the optimizer stepped.
        loss: the window's loss record; None when the window held no items (keep the last one).
        items_scale: across ranks, the window's item total per rank (the next window's
            provisional total); None to keep the current one.
        grad_norm: the gradient's norm before clipping, when clipping or a check computed it.
        no_grads: no parameter of the optimizer had a gradient.
    """

    stepped: bool
    loss: WindowLoss | None = None
    items_scale: Any = None
    grad_norm: torch.Tensor | None = None
    no_grads: bool = False


def sum_losses(losses: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The sum of a window's scaled micro-batch losses (None for none)."""
    if not losses:
        return None
    return losses[0] if len(losses) == 1 else torch.stack(list(losses)).sum()


def apply_window(window: Window, losses: Sequence[torch.Tensor], sync: GradSync,
                 precision: Precision, clip_norm: float | None) -> Outcome:
    """Reduce, normalize, clip and step for one complete (or flushed) window.

    Raises:
        RuntimeError: under DDP/FSDP2, no forward ran through the wrapped model this window.
        Whatever the scaler or the optimizer raises.
    """
    sync.check_forward()
    distributed = sync.world_size > 1
    items = window.items if window.weighting == "items" else None
    loss_sum, items = sync.reduce_window(sum_losses(losses) if distributed else None, items)
    # A summed window may hold no items at all: its total is read once (a host read for a tensor).
    empty = window.summed and not is_nonzero(items)
    scale = items if distributed and items is not None and not empty else None
    if empty:
        return Outcome(False, items_scale=scale)
    factor = window.grad_factor(items)
    loss = WindowLoss((loss_sum,) if distributed else tuple(losses), factor)
    grads = precision.window_grads()
    norm = scale_and_clip_(grads, factor, clip_norm)
    stepped, norm = precision.step(grads, norm)
    return Outcome(stepped, loss, scale, norm, no_grads=not grads)
