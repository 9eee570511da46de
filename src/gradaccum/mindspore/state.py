"""Checkpointable state of the MindSpore accumulator: pack, check and restore (host side).

The record is the core's (:mod:`gradaccum.core.checkpoint`), so a state reads the same on both
backends; the partial gradients are NumPy copies, so a state pickles without MindSpore. Loading
is two steps: :func:`check` validates every field and converts what it will write (nothing
changes if it raises); the accumulator then writes it all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import numpy as np
from mindspore import Parameter, Tensor

from gradaccum.core import Schedule, Window
from gradaccum.core.checkpoint import (
    FORMAT_VERSION,
    check_optional_number,
    check_record_keys,
    check_state_record,
    param_signature,
)
from gradaccum.core.validate import check_nonneg_int

__all__ = ["KEYS", "Saved", "check", "pack"]

KEYS = ("version", "steps", "window", "optimizer_steps", "skipped_windows", "epoch",
        "param_signature", "grads")  # "window_loss" and "loss_sum" may be absent (None)
_INT32_MAX, _INT64_MAX = 2**31 - 1, 2**63 - 1


@dataclass(frozen=True)
class Saved:
    """A checked state, ready to write: the window, the counters, the buffers as Tensors."""

    window: Window
    next_size: int
    optimizer_steps: int
    epoch: int
    grads: list[Tensor]
    window_loss: float | None
    loss_sum: float | None


def pack(window: Window, steps: Any, counters: tuple[int, int], buffers: Sequence[Parameter],
         losses: tuple[float | None, float | None]) -> dict[str, Any]:
    """The state record: counters ``(optimizer_steps, epoch)``, the window, the losses
    ``(window_loss, loss_sum)`` and copies of the partial gradients."""
    return {
        "version": FORMAT_VERSION,
        "steps": steps,
        "window": {"size": window.size, "micro_step": window.micro_step,
                   "weighting": window.weighting, "items": int(window.items)},
        "optimizer_steps": counters[0],
        "skipped_windows": 0,
        "epoch": counters[1],
        "window_loss": losses[0],
        "loss_sum": losses[1],
        "param_signature": param_signature(buffers),
        # An empty window's buffer holds the last window's values (the next micro-batch
        # overwrites them): save zeros, what the window holds.
        "grads": [np.zeros(b.shape, b.asnumpy().dtype) if window.empty
                  else np.array(b.asnumpy(), copy=True) for b in buffers],
    }


def check(state: Any, schedule: Schedule, weighting: str, buffers: Sequence[Parameter]) -> Saved:
    """Check every field of ``state`` this accumulator will use, before anything changes.

    Returns:
        What to write, validated and converted.

    Raises:
        TypeError, ValueError: the first bad field, named (``state['optimizer_steps']``); see also
            :func:`gradaccum.core.check_state_record` (version, steps, parameters).
    """
    check_record_keys(state, KEYS)
    window = check_state_record(state, schedule.describe(), param_signature(buffers))
    if window.weighting not in (None, weighting):
        raise ValueError(f"state holds a window with weighting={window.weighting!r}, this "
                         f"accumulator has weighting={weighting!r}")
    if not isinstance(window.items, Integral) or int(window.items) > _INT64_MAX:
        raise ValueError(f"state['window']['items'] must be an integer count below 2**63 here, "
                         f"got {window.items!r}")
    if window.size > _INT32_MAX:
        raise ValueError(f"state['window']['size'] must be below 2**31, got {window.size}")
    steps = check_nonneg_int("state['optimizer_steps']", state["optimizer_steps"])
    if steps > _INT64_MAX:
        raise ValueError(f"state['optimizer_steps'] must be below 2**63, got {steps}")
    epoch = check_nonneg_int("state['epoch']", state["epoch"])
    if schedule.by == "optimizer_step" and window.size != schedule(steps):
        raise ValueError(f"state['window']['size'] is {window.size}, but steps={schedule.describe()!r} "
                         f"opens windows of {schedule(steps)} at optimizer step {steps}")
    loss_sum = check_optional_number(state, "loss_sum")
    if loss_sum is not None and window.empty:
        raise ValueError(f"state['loss_sum'] is {loss_sum!r} for an empty window (None expected)")
    return Saved(window, schedule(epoch) if schedule.by == "epoch" else window.size, steps, epoch,
                 [_grad(i, g, b) for i, (g, b) in enumerate(zip(state["grads"], buffers, strict=True))],
                 check_optional_number(state, "window_loss"), loss_sum)


def _grad(i: int, saved: Any, buffer: Parameter) -> Tensor:
    """A saved partial gradient as a Tensor for ``buffer`` (``None``: zeros, as torch saves an
    unused parameter's gradient)."""
    if saved is None:
        return Tensor(np.zeros(buffer.shape), dtype=buffer.dtype)
    array = np.asarray(saved)
    if array.dtype.kind not in "fiu":
        raise TypeError(f"state['grads'][{i}] must be a numeric array, got dtype {array.dtype}")
    if array.shape != tuple(buffer.shape):
        raise ValueError(f"state['grads'][{i}] has shape {array.shape}, the parameter has "
                         f"{tuple(buffer.shape)}")
    return Tensor(array, dtype=buffer.dtype)
