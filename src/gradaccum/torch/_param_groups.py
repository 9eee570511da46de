"""The optimizer's parameters, read from its groups; and the groups it gains while training.

``optimizer.add_param_group(...)`` after the accumulator was built (progressive unfreezing) adds
parameters that the accumulator's parts did not take: unnormalized, unclipped, unsaved and
unguarded, they would train silently wrong. The accumulator compares the optimizer's parameter
count with its own once per window, at the window's first micro-batch, and on a change every part
takes the new list there, as a new accumulator would (``Accumulator._take_groups``). A group
added inside an open window whose parameters already hold gradients is refused at the window's
boundary (:func:`refuse_added_inside`): those gradients hold only part of the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["optimizer_params", "param_count", "refuse_added_inside"]


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    """Every parameter of ``optimizer``'s groups, in order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def param_count(optimizer: Any) -> int:
    """How many parameters ``optimizer``'s groups hold (a sum over its few groups)."""
    return sum(len(group["params"]) for group in optimizer.param_groups)


def refuse_added_inside(optimizer: Any, params: Sequence[torch.Tensor]) -> None:
    """At a window's boundary: raise if the optimizer gained parameters during the window that
    already hold gradients (``params``: those the accumulator took). Parameters added without a
    gradient step with none, and are taken in at the next window's first micro-batch.

    Raises:
        RuntimeError: naming the fix.
    """
    if param_count(optimizer) == len(params):
        return
    known = {id(p) for p in params}
    added = [p for p in optimizer_params(optimizer) if id(p) not in known]
    held = sum(p.grad is not None for p in added)
    if not held:
        return
    raise RuntimeError(
        f"optimizer.add_param_group() was called inside an open window: {held} of its {len(added)} "
        "new parameter(s) hold gradients of only part of the window, which the accumulator did not "
        "normalize. Add parameter groups between windows (right after acc.backward() returns True, "
        "or before the first micro-batch): the accumulator takes them in at the next window's first "
        "micro-batch")
