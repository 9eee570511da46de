"""The loss of an applied window, weighted like its gradient and summed only when read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.core.window import is_one

__all__ = ["WindowLoss", "sum_losses"]


def sum_losses(losses: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The sum of a window's scaled micro-batch losses (None for none)."""
    return _sum(losses) if losses else None


def _sum(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    return losses[0] if len(losses) == 1 else torch.stack(list(losses)).sum()


@dataclass(frozen=True)
class WindowLoss:
    """The scaled micro-batch losses of one window (or their sum reduced over ranks) and the
    window's gradient factor: their sum times the factor is the window's loss.

    Reading :meth:`value` costs one small sum on the losses' device and never synchronizes it;
    a loop that never logs the loss pays nothing.

    Example:
        >>> WindowLoss((torch.tensor(0.5), torch.tensor(1.5)), 0.5).value()
        tensor(1.)
    """

    parts: tuple[torch.Tensor, ...]
    factor: Any

    def value(self) -> torch.Tensor:
        """The window's loss, a 0-dim tensor."""
        total = _sum(self.parts)
        return total if is_one(self.factor) else total * self.factor
