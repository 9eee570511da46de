"""The handle of a micro-batch fed by several backward calls (multi-task losses, and loss terms
of different normalizers: :mod:`gradaccum.torch._terms`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gradaccum.torch._validate import check_loss

__all__ = ["MicroBatch", "micro_batch_block"]

# One loss's backward: (loss, n_items, total, reduction) -> its (loss, weight) part.
TermBackward = Callable[[torch.Tensor, Any, Any, Any], tuple[torch.Tensor, Any]]


class MicroBatch:
    """One micro-batch fed by several backward calls; see ``Accumulator.micro_batch``.

    Args:
        backward: runs one loss's backward (``loss, n_items, total, reduction``) with its weight
            and returns its ``(loss, weight)`` part of the window's loss.

    Attributes:
        stepped: after the block, True when the micro-batch completed a window that stepped.
        closed: True once the ``with`` block has ended (``backward`` then raises).
    """

    def __init__(self, backward: TermBackward) -> None:
        self._backward = backward
        self.parts: list[tuple[torch.Tensor, Any]] = []
        self.stepped = False
        self.closed = False

    def backward(self, loss: torch.Tensor, n_items: Any = None, *, total: Any = None,
                 reduction: str = "mean") -> None:
        """Backward one task's loss right away.

        Args:
            loss: the loss, reduced like the block's ``reduction`` when no ``total`` is given.
            n_items: with ``total``: this term's items in the micro-batch (its loss is their mean,
                or their sum with ``reduction="sum"``, where it may be omitted).
            total: the term's total over the window, every micro-batch and rank (a number > 0 or
                a 0-dim tensor): the term weighs ``n_items / total`` (``1 / total`` summed) in the
                window's gradient, whatever the block's weighting. Only in a block opened without
                ``n_items``, whose plain losses are then a mean over the window's micro-batches.
            reduction: ``"mean"`` or ``"sum"``, for a term with ``total``.

        Raises:
            RuntimeError: the ``with`` block of this micro-batch has ended.
            TypeError, ValueError: a bad ``loss``, ``n_items``, ``total`` or ``reduction``, or a
                ``total`` in a block opened with ``n_items``; raised before the backward runs.
        """
        if self.closed:
            raise RuntimeError("this micro-batch's with-block has ended: open a new one with "
                               "acc.micro_batch()")
        check_loss(loss)
        self.parts.append(self._backward(loss, n_items, total, reduction))


@contextmanager
def micro_batch_block(backward: TermBackward) -> Iterator[MicroBatch]:
    """A :class:`MicroBatch` open for the ``with`` block and closed when it ends (also on error)."""
    mb = MicroBatch(backward)
    try:
        yield mb
    finally:
        mb.closed = True
