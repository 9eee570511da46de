"""The loss of an applied window, weighted like its gradient and summed only when read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradaccum.core.window import is_one

__all__ = ["WindowLoss"]


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
        total = self.parts[0] if len(self.parts) == 1 else torch.stack(self.parts).sum()
        return total if is_one(self.factor) else total * self.factor
