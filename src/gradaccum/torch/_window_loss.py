"""The loss of a window, weighted like its gradient and summed only when read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.core.window import is_one

__all__ = ["WindowLoss", "weighted_sum"]


def weighted_sum(parts: Sequence[tuple[torch.Tensor, Any]]) -> torch.Tensor | None:
    """``sum(loss * weight)`` over a window's ``(loss, weight)`` parts (None for none).

    Example:
        >>> weighted_sum([(torch.tensor(0.5), 2), (torch.tensor(1.0), 1)])
        tensor(2.)
    """
    if not parts:
        return None
    terms = [loss if is_one(w) else loss * w for loss, w in parts]
    return terms[0] if len(terms) == 1 else torch.stack([t.to(terms[0].dtype) for t in terms]).sum()


@dataclass(frozen=True)
class WindowLoss:
    """A window's ``(loss, weight)`` parts and their denominator: the window's loss is
    ``sum(loss * weight) / denominator``.

    Reading :meth:`value` costs a few small ops on the losses' device and never synchronizes it;
    a loop that never logs the loss pays nothing.

    Example:
        >>> WindowLoss(((torch.tensor(0.5), 1), (torch.tensor(1.5), 1)), 2).value()
        tensor(1.)
    """

    parts: tuple[tuple[torch.Tensor, Any], ...]
    denominator: Any

    def value(self) -> torch.Tensor:
        """The window's loss, a 0-dim tensor."""
        total = weighted_sum(self.parts)
        assert total is not None  # a window with a loss has at least one part
        dtype = self.parts[0][0].dtype
        total = total.reshape(())
        return total if is_one(self.denominator) else (total / self.denominator).to(dtype)
