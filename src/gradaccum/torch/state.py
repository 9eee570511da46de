"""Checkpointable accumulator state: pack, validate, restore partial gradients."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradaccum.core import Window

__all__ = ["FORMAT_VERSION", "check_state", "param_signature", "restore_grads", "snapshot_grads",
           "window_from_state", "window_state"]

FORMAT_VERSION = 1


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


def window_from_state(w: Mapping[str, Any]) -> Window:
    """The window saved by :func:`window_state` (its size validated)."""
    return Window(Window.open(w["size"]).size, w["micro_step"], w["weighting"], w["items"])


def check_state(state: Any, steps: Any, params: Sequence[torch.Tensor]) -> None:
    """Check that ``state`` came from an accumulator like this one, before anything changes.

    Raises:
        TypeError: ``state`` is not a mapping from :meth:`Accumulator.state_dict`.
        ValueError: another format version, another ``steps``, or other parameters.
    """
    if not isinstance(state, Mapping) or "grads" not in state or "window" not in state:
        raise TypeError(f"state must be a dict from Accumulator.state_dict(), got {type(state).__name__}")
    if state.get("version") != FORMAT_VERSION:
        raise ValueError(f"state has format version {state.get('version')!r}, expected {FORMAT_VERSION}")
    if state["steps"] != steps:
        raise ValueError(
            f"state was saved with steps={state['steps']!r}, this accumulator has steps={steps!r}"
        )
    saved, ours = state["param_signature"], param_signature(params)
    if saved != ours:
        where = "" if len(saved) != len(ours) else (
            f"; first difference at parameter {_first_difference(saved, ours)}")
        raise ValueError(
            f"state was saved for other parameters: {len(saved)} saved, {len(ours)} here{where}"
        )
    grads = state["grads"]
    if len(grads) != len(ours):
        raise ValueError(f"state holds {len(grads)} gradients for {len(ours)} parameters")


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


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
