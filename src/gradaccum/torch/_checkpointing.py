"""The accumulator's checkpoint: ``state_dict`` and ``load_state_dict``, as a mixin.

:class:`~gradaccum.Accumulator` inherits these two methods; the record they save and check is in
``torch/_state.py``. Everything they read or restore is the accumulator's: its window record,
counters, partial gradients, precision buffers, and the other accumulators over its parameters.
"""

from __future__ import annotations

from typing import Any

import torch

from gradaccum.core.checkpoint import COUNTERS
from gradaccum.core.schedule import Schedule
from gradaccum.core.window import Window
from gradaccum.torch._feeds import refuse_partial
from gradaccum.torch._guards import Guard
from gradaccum.torch._holders import Holders
from gradaccum.torch._precision import Precision
from gradaccum.torch._state import check_state, pack_state, restore_grads, restore_window
from gradaccum.torch._window_loss import WindowLoss
from gradaccum.torch.distributed.base import GradSync

__all__ = ["Checkpointing"]


class Checkpointing:
    """``state_dict``/``load_state_dict`` of :class:`~gradaccum.Accumulator` (set in its
    ``__init__``: the attributes below)."""

    schedule: Schedule
    _window: Window
    _last_loss: WindowLoss | None
    _params: list[torch.Tensor]
    _precision: Precision
    _sync: GradSync
    _holders: Holders
    _guard: Guard
    _partial: str | None

    def _last_window_loss(self) -> torch.Tensor | None:
        """The last applied window's loss (``Accumulator.window_loss``), summed now."""
        return None if self._last_loss is None else self._last_loss.value()

    def state_dict(self) -> dict[str, Any]:
        """All a bit-exact resume in the middle of a window needs (counters, window, partial
        gradients and losses, the last window's loss); save it beside the model's and optimizer's.

        Raises:
            RuntimeError: mid-window under FSDP2 with ``sync="window"``, whose partial gradients
                live inside FSDP2 (save at ``micro_step == 0``); a window a ``backward_cached``
                call left partly accumulated (``discard()`` it).
        """
        refuse_partial(self._partial, self._window.micro_step)
        if not self._window.empty:
            self._sync.check_saveable()
        return pack_state(self._window, self.schedule.describe(), {k: getattr(self, k) for k in COUNTERS},
                          self._last_window_loss(), self._params, self._precision.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`, partial gradients included.

        The window resumes at the size it was saved with (the one it opened with: a window
        carried into a new epoch by :meth:`set_epoch`, or sized by :meth:`resize_window`, keeps
        it); the next window reads the schedule. Every state :meth:`state_dict` writes loads
        into an accumulator built the same way.

        Raises:
            TypeError, ValueError: a field is missing, of the wrong type or out of range (the
                message names the key), or the state comes from an accumulator with another
                ``steps`` or other parameters; nothing is changed then.
            RuntimeError: another live accumulator holds a partial window over these parameters
                (loading would overwrite its gradients); nothing is changed.
        """
        window = check_state(state, self.schedule.describe(), self._params)
        self._check_size(window)
        self._precision.check_state(state.get("accum"))
        # Loading sets the shared .grad (to None for an empty window): never under another's window.
        self._holders.refuse_overlap(self, "load a partial window" if not window.empty else
                                     "load a state with an empty window", "overwrite")
        restore_grads(self._params, state["grads"])
        self._partial = None  # every gradient and the window are the state's
        self._precision.load_state_dict(state.get("accum"))
        for key in COUNTERS:
            setattr(self, key, state[key])
        last = state.get("window_loss")
        self._last_loss = None if last is None else WindowLoss(((last, 1),), 1)
        self._window = restore_window(state, window)
        self._sync.prepare(self._window.next_is_last)
        self._holders.adopt()
        self._guard.resume(self._window.micro_step)

    def _check_size(self, window: Window) -> None:
        """A saved window's size is the one ``steps`` gave when it opened (else the window would
        never complete, or complete early). A window keeps its size to its boundary: the count
        checked is the one it opened at, not the saved counters (an epoch schedule's window
        carried into the next epoch). A resized window (``resize_window``, AutoBatch), or one
        saved before the count was recorded (gradaccum 0.3.0 and older), is taken as saved."""
        at = window.opened_at
        if at is None:
            return
        want = self.schedule(at)
        if window.size != want:
            count = "epoch" if self.schedule.by == "epoch" else "optimizer step"
            raise ValueError(f"state['window']['size'] is {window.size}, but steps="
                             f"{self.schedule.describe()!r} gives {want} at {count} {at}, where "
                             "the window opened (state['window']['opened_at']): not a state this "
                             "accumulator wrote; resume from an unedited Accumulator.state_dict()")
