"""Argument checks of the MindSpore adapter (the framework-free ones live in ``gradaccum.core``).

:func:`check_call` runs inside compiled graphs, so it tests only what is constant when a graph
compiles (types, dtypes, shapes, lengths, Python ints): a failed check then fails the compile,
before anything changes. A raise that depends on a tensor's value would run inside the graph,
and MindSpore 2.10 cannot run a graph again once it has raised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mindspore as ms
from mindspore import Tensor, nn

from gradaccum.core import Schedule

__all__ = ["check_call", "check_parts"]

FLOAT_DTYPES = (ms.float16, ms.bfloat16, ms.float32, ms.float64)
INT_DTYPES = (ms.int8, ms.int16, ms.int32, ms.int64, ms.uint8, ms.uint16, ms.uint32, ms.uint64)


def check_parts(optimizer: Any, weighting: Any, schedule: Schedule) -> None:
    """Check what an :class:`~gradaccum.mindspore.Accumulator` is built from.

    Raises:
        TypeError: not a ``mindspore.nn.Optimizer``, or a callable schedule counted in optimizer
            steps (Python cannot run inside the graph when a window opens).
        ValueError: an unknown weighting.
    """
    if not isinstance(optimizer, nn.Optimizer):
        raise TypeError(f"optimizer must be a mindspore.nn.Optimizer, got {type(optimizer).__name__}")
    if weighting not in ("mean", "items"):
        raise ValueError(f"weighting must be 'mean' or 'items', got {weighting!r}")
    if schedule.by == "optimizer_step" and schedule.table() is None:
        raise TypeError(
            f"steps={schedule.describe()!r}: a callable counted in optimizer steps cannot run "
            "inside a compiled graph; give an int, a mapping {optimizer_step: N}, or "
            "Schedule(fn, by='epoch') with set_epoch()"
        )


def check_call(n_buffers: int, weighting: str, grads: Sequence[Tensor], n_items: Any,
               loss: Any = None) -> None:
    """Check one call's ``grads``, ``n_items`` and ``loss`` (graph-compatible, see the module
    docstring).

    Raises:
        TypeError: ``n_items`` or ``loss`` of the wrong type or dtype.
        ValueError: the wrong number of gradients, ``n_items`` missing or unexpected for the
            weighting, an int below 1, or a tensor with more than one element.
    """
    if loss is not None:
        if not isinstance(loss, Tensor):
            raise TypeError(f"loss must be the micro-batch's loss as a float Tensor, got "
                            f"{type(loss).__name__}")
        if loss.dtype not in FLOAT_DTYPES:
            raise TypeError(f"loss must be a float Tensor, got a {loss.dtype} Tensor")
        if loss.size != 1:
            raise ValueError(f"loss must be a scalar (the micro-batch's mean loss), got a Tensor of "
                             f"shape {loss.shape}")
    if len(grads) != n_buffers:
        raise ValueError(f"grads holds {len(grads)} tensors for the optimizer's {n_buffers} parameters")
    if n_items is None:
        if weighting == "items":
            raise ValueError("n_items=None: this Accumulator has weighting='items', so every "
                             "micro-batch must pass its n_items")
    elif weighting == "mean":
        raise ValueError("n_items was given to an Accumulator with weighting='mean'; build it "
                         "with weighting='items' to weight micro-batches by their items")
    elif isinstance(n_items, (bool, float)):
        raise TypeError(f"n_items must be an integer count, got {n_items!r}")
    elif isinstance(n_items, int):
        if n_items < 1:
            raise ValueError(f"n_items must be >= 1, got {n_items!r}")
    elif not isinstance(n_items, Tensor):
        raise TypeError("n_items must be an int or an integer Tensor")
    elif n_items.dtype not in INT_DTYPES:
        raise TypeError(f"n_items must be an integer count, got a {n_items.dtype} Tensor")
    elif n_items.size != 1:
        raise ValueError(f"n_items must be a scalar, got a Tensor of shape {n_items.shape}")
