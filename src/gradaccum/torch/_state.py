"""Checkpointable accumulator state: pack, validate, restore partial gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradaccum.core import Window
from gradaccum.core.checkpoint import FORMAT_VERSION, check_state_record

__all__ = ["FORMAT_VERSION", "check_state", "param_signature", "restore_grads", "snapshot_grads",
           "window_state"]


def param_signature(params: Sequence[torch.Tensor]) -> list[list[Any]]:
    """Shape and dtype of every parameter, to recognize a state from other parameters."""
    return [[list(p.shape), str(p.dtype)] for p in params]


def snapshot_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Copies of the partial gradients (later micro-batches add into the live ones in place)."""
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def window_state(window: Window) -> dict[str, Any]:
    """The window as checkpoint values (a tensor item total is copied)."""
    items = window.items
    return {"size": window.size, "micro_step": window.micro_step, "weighting": window.weighting,
            "items": items.detach().clone() if isinstance(items, torch.Tensor) else items}


def check_state(state: Any, steps: Any, params: Sequence[torch.Tensor]) -> None:
    """Check that ``state`` came from an accumulator like this one, before anything changes.

    Raises:
        TypeError: ``state`` is not a mapping from :meth:`Accumulator.state_dict`.
        ValueError: another format version, another ``steps``, or other parameters.
    """
    check_state_record(state, steps, param_signature(params))


def restore_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Put saved partial gradients back into ``.grad`` (in place where a gradient exists, so
    views such as DDP's gradient buckets stay intact)."""
    for p, g in zip(params, grads, strict=True):
        if g is None:
            p.grad = None
        elif p.grad is not None and p.grad.shape == g.shape:
            p.grad.copy_(g)
        else:
            p.grad = g.detach().to(device=p.device, dtype=p.dtype).clone()
