"""Checkpointable state of the MindSpore accumulator: pack, check and restore (host side).

The record is the core's (:mod:`gradaccum.core.checkpoint`), so a state reads the same on both
backends; the partial gradients are NumPy copies, so a state pickles without MindSpore.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from mindspore import Parameter, Tensor

from gradaccum.core import Window
from gradaccum.core.checkpoint import FORMAT_VERSION, check_state_record, window_from_record

__all__ = ["check", "pack", "param_signature", "restore"]


def param_signature(params: Sequence[Parameter]) -> list[list[Any]]:
    """Shape and dtype of every buffer, to recognize a state saved for other parameters.

    Example:
        >>> import mindspore as ms
        >>> param_signature([ms.Parameter(ms.ops.zeros((2, 3)), "w")])
        [[[2, 3], 'Float32']]
    """
    return [[list(p.shape), str(p.dtype)] for p in params]


def pack(window: Window, steps: Any, optimizer_steps: int, epoch: int,
         buffers: Sequence[Parameter]) -> dict[str, Any]:
    """The state record: counters, the window, and copies of the partial gradients."""
    return {
        "version": FORMAT_VERSION,
        "steps": steps,
        "window": {"size": window.size, "micro_step": window.micro_step,
                   "weighting": window.weighting, "items": int(window.items)},
        "optimizer_steps": optimizer_steps,
        "skipped_windows": 0,
        "epoch": epoch,
        "param_signature": param_signature(buffers),
        # An empty window's buffer holds the last window's values (the next micro-batch
        # overwrites them): save zeros, what the window holds.
        "grads": [np.zeros(b.shape, b.asnumpy().dtype) if window.empty
                  else np.array(b.asnumpy(), copy=True) for b in buffers],
    }


def check(state: Any, steps: Any, weighting: str, buffers: Sequence[Parameter]) -> Window:
    """Check a state against this accumulator before anything changes.

    Returns:
        The saved window, rebuilt (and so validated) by the core.

    Raises:
        TypeError, ValueError: see :func:`gradaccum.core.check_state_record`; also a window of
            the other weighting, or a gradient of the wrong shape.
    """
    check_state_record(state, steps, param_signature(buffers))
    window = window_from_record(state["window"])
    if window.weighting not in (None, weighting):
        raise ValueError(f"state holds a window with weighting={window.weighting!r}, this "
                         f"accumulator has weighting={weighting!r}")
    for i, (g, b) in enumerate(zip(state["grads"], buffers, strict=True)):
        if np.shape(g) != tuple(b.shape):
            raise ValueError(f"state gradient {i} has shape {np.shape(g)}, buffer has {tuple(b.shape)}")
    return window


def restore(state: dict[str, Any], buffers: Sequence[Parameter]) -> None:
    """Copy the saved partial gradients into the accumulation buffers."""
    for g, b in zip(state["grads"], buffers, strict=True):
        b.set_data(Tensor(np.asarray(g), dtype=b.dtype))
