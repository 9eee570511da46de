"""The step at a window boundary: from the reduction across ranks to the optimizer step.

:func:`step_window` is the boundary without the accumulator's bookkeeping: it reduces the
window's item total (and, across ranks, its loss), skips a summed window of no items, unscales,
normalizes and clips the gradients, and steps the optimizer unless the gradient is non-finite.
The accumulator then counts, steps the scheduler and opens the next window whatever happened
(``Accumulator._close_window``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.core.terms import check_term_totals, term_sums
from gradaccum.core.window import Window
from gradaccum.torch._grads import scale_and_clip_
from gradaccum.torch._precision import Precision
from gradaccum.torch._weights import float_total
from gradaccum.torch._window_loss import WindowLoss, weighted_sum
from gradaccum.torch.distributed.base import GradSync

__all__ = ["Outcome", "step_window"]


@dataclass(frozen=True)
class Outcome:
    """What a boundary did.

    Attributes:
        stepped: the optimizer stepped.
        basis: the count per micro-batch the next window's provisional total derives from.
        loss: the window's loss record; None when the window held no items (keep the last one).
        grad_norm: the gradient's norm before clipping, when clipping or a check computed it.
        no_grads: no parameter of the optimizer had a gradient.
    """

    stepped: bool
    basis: Any = None
    loss: WindowLoss | None = None
    grad_norm: torch.Tensor | None = None
    no_grads: bool = False


def step_window(window: Window, sync: GradSync, precision: Precision, clip_norm: float | None) -> Outcome:
    """Reduce, normalize, clip and step for one complete (or flushed) window.

    Under several ranks nothing here raises on one rank alone before the optimizer step: a
    refusal a guard deferred in the window (or no forward through the wrapper on this rank) is
    raised on every rank together, after the window's collectives (``sync.raise_deferred``).

    Raises:
        RuntimeError: under DDP/FSDP2, no forward ran through the wrapped model this window, or a
            rank's guard refused the window (raised on every rank).
        ValueError: a term's ``total=`` is not its counts' sum over the window and the ranks.
        Whatever the scaler or the optimizer raises.
    """
    ranks = sync.world_size > 1
    try:
        sync.check_forward()
    except RuntimeError as e:
        if not ranks:
            raise
        sync.defer(str(e))
    items = window.items if window.weighting == "items" else None
    sums = term_sums(window.terms)
    if ranks:
        loss_sum, items, sums = sync.reduce_window(weighted_sum(window.losses), items, sums)
        loss = WindowLoss(((loss_sum, 1),), window.loss_denominator(items))
    else:
        loss = WindowLoss(window.losses, window.loss_denominator())
    if window.terms:  # every rank holds the same sums: every rank raises, or none
        check_term_totals(window.terms, sums, sync.world_size)
    basis = window.next_basis(items) if window.scale is not None or precision.overflow_prone else None
    # A summed window may hold no items at all: its total is read once (a host read for a tensor).
    if window.summed and not bool(window.items > 0 if items is None else items > 0):
        sync.raise_deferred()
        return Outcome(False, window.basis)
    if precision.buffers is not None and sync.world_size > 1:
        precision.average_over_ranks(sync)  # float32 sums, reduced once (DDP reduced nothing)
    grads = precision.window_grads()
    norm = scale_and_clip_(grads, window.grad_factor(float_total(window.items if items is None else items)),
                           clip_norm)
    if ranks:
        sync.raise_deferred()  # after the clip's norm (a collective under FSDP2), before the step
    stepped, norm = precision.step(grads, norm)
    return Outcome(stepped, basis, loss, norm, no_grads=not grads)
