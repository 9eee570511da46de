"""A checkpoint that holds the optimizer's state but not the accumulator's, taken mid-window.

A run resumed from it starts an empty window where the saved one held micro-batches: their partial
gradients are lost, and nothing fails (an accumulator that Accelerate's ``save_state`` does not
know of, because it was not registered, is the common case). Neither the optimizer nor the
accumulator sees the checkpoint as a whole, so the check pairs what each sees: a state-dict
pre-hook on the optimizer notes where in the window its state was taken, the accumulator's own
``state_dict`` notes where its state was taken, and at the window's boundary (once per window,
nothing per micro-step) a mid-window optimizer state with no accumulator state at the same point
is warned about, once. A checkpoint that saves both (in either order, as docs/GUIDE.md's does)
passes; so does one taken at a boundary, where there is no partial window to lose.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch

from gradaccum.torch._hooks import hook_optimizer, retire

__all__ = ["SaveWatch"]

_PACKAGE = str(Path(__file__).resolve().parents[1])


def _user_level() -> int:
    """The ``stacklevel`` of the first caller outside gradaccum (a boundary is reached from
    ``backward``, ``flush`` or ``micro_batch``, at different depths)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def _in_accelerate(optimizer: Any) -> bool:
    """The optimizer is Accelerate's, or an Accelerator was made in this process: the by-hand
    recipe of docs/INTEGRATIONS.md gives the accumulator the prepared optimizer's inner one, a
    torch optimizer that ``save_state`` saves all the same."""
    if type(optimizer).__module__.split(".")[0] == "accelerate":
        return True
    state = sys.modules.get("accelerate.state")
    return state is not None and bool(getattr(state.PartialState, "_shared_state", None))


class SaveWatch:
    """The points in the window where the optimizer's and the accumulator's states were taken.

    It reads the accumulator's public ``windows`` and ``micro_step`` and registers its check with
    ``register_boundary_hook``; the accumulator tells it of its own ``state_dict`` (:meth:`own_saved`).

    Args:
        acc: the accumulator (held weakly).
        optimizer: its optimizer (a wrapper's inner one is watched).
    """

    def __init__(self, acc: Any, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer_at: tuple[int, int] | None = None  # (window, micro-step), mid-window only
        self.own_at: tuple[int, int] | None = None
        self.warned = False
        self.accelerate = _in_accelerate(optimizer)
        ref = weakref.ref(acc)

        def optimizer_saved(opt: Any) -> None:
            owner = ref()
            if owner is not None and owner.micro_step:
                self.optimizer_at = (owner.windows, owner.micro_step)

        # A wrapper's state_dict (AcceleratedOptimizer's) is the inner one's: hook that one.
        handle = hook_optimizer(optimizer, lambda inner: inner.register_state_dict_pre_hook(optimizer_saved))
        weakref.finalize(acc, retire, handle)
        acc.register_boundary_hook(self.check)

    def own_saved(self, windows: int, micro_step: int) -> None:
        """The accumulator's own ``state_dict`` was taken at ``micro_step`` of window ``windows``."""
        self.own_at = (windows, micro_step)

    def check(self, acc: Any) -> None:
        """At a boundary: warn once if the window's optimizer state was saved without ours."""
        saved, self.optimizer_at = self.optimizer_at, None
        if saved is None or saved == self.own_at or self.warned:
            return
        self.warned = True
        fix = ("use gradaccum.integrations.accelerate.Accumulator, or "
               "accelerator.register_for_checkpointing(acc), so that save_state keeps the partial window"
               if self.accelerate else
               "save acc.state_dict() beside it, and acc.load_state_dict(...) when you resume")
        warnings.warn(
            f"the optimizer's state was saved in the middle of a window (after micro-batch {saved[1]} "
            f"of {acc.steps}) without the accumulator's: a run resumed from that checkpoint loses the "
            f"window's partial gradients. {fix[0].upper()}{fix[1:]}", UserWarning, stacklevel=_user_level())
