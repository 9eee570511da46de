"""The handle of a micro-batch fed by several backward calls (multi-task losses)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gradaccum.torch._validate import check_loss

__all__ = ["MicroBatch", "micro_batch_block"]


class MicroBatch:
    """One micro-batch fed by several backward calls; see ``Accumulator.micro_batch``.

    Args:
        backward: runs one loss's backward with the micro-batch's weight and returns its
            ``(loss, weight)`` part of the window's loss.

    Attributes:
        stepped: after the block, True when the micro-batch completed a window that stepped.
        closed: True once the ``with`` block has ended (``backward`` then raises).
    """

    def __init__(self, backward: Callable[[torch.Tensor], tuple[torch.Tensor, Any]]) -> None:
        self._backward = backward
        self.parts: list[tuple[torch.Tensor, Any]] = []
        self.stepped = False
        self.closed = False

    def backward(self, loss: torch.Tensor) -> None:
        """Backward one task's loss (reduced like the block's ``reduction``) right away.

        Raises:
            RuntimeError: the ``with`` block of this micro-batch has ended.
            TypeError, ValueError: a bad ``loss``.
        """
        if self.closed:
            raise RuntimeError("this micro-batch's with-block has ended: open a new one with "
                               "acc.micro_batch()")
        check_loss(loss)
        self.parts.append(self._backward(loss))


@contextmanager
def micro_batch_block(backward: Callable[[torch.Tensor], tuple[torch.Tensor, Any]]) -> Iterator[MicroBatch]:
    """A :class:`MicroBatch` open for the ``with`` block and closed when it ends (also on error)."""
    mb = MicroBatch(backward)
    try:
        yield mb
    finally:
        mb.closed = True
