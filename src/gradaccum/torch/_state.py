"""Checkpointable accumulator state: pack, validate every field, restore partial gradients."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real
from typing import Any

import torch

from gradaccum.core.checkpoint import FORMAT_VERSION, check_state_record, nonneg_finite, param_signature
from gradaccum.core.window import Window

__all__ = ["FORMAT_VERSION", "check_state", "clone_scalar", "pack_state", "restore_grads",
           "snapshot_grads", "window_state"]


def snapshot_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Copies of the partial gradients (later micro-batches add into the live ones in place)."""
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def clone_scalar(value: Any) -> Any:
    """A copy of a tensor scalar (a number or None as it is)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def window_state(window: Window) -> dict[str, Any]:
    """The window as checkpoint values (tensor totals are copied)."""
    return {"size": window.size, "micro_step": window.micro_step, "weighting": window.weighting,
            "items": clone_scalar(window.items), "scale": clone_scalar(window.scale), "summed": window.summed}


def pack_state(window: Window, steps: Any, counters: dict[str, int], loss_sum: torch.Tensor | None,
               window_loss: torch.Tensor | None, most_items: tuple[Any, Any], params: Sequence[torch.Tensor],
               accum: Any) -> dict[str, Any]:
    """The accumulator's state as a checkpoint record (tensors copied, so later micro-batches
    leave it as it was)."""
    return {
        "version": FORMAT_VERSION,
        "steps": steps,
        "window": window_state(window),
        **counters,
        "loss_sum": clone_scalar(loss_sum),
        "window_loss": clone_scalar(window_loss),
        "most_items": clone_scalar(most_items[0]),
        "window_most_items": clone_scalar(most_items[1]),
        "param_signature": param_signature(params),
        "grads": snapshot_grads(params),
        "accum": accum,
    }


def check_state(state: Any, steps: Any, params: Sequence[torch.Tensor]) -> Window:
    """Check every field :meth:`Accumulator.load_state_dict` will use, before anything changes.

    Returns:
        The saved window.

    Raises:
        TypeError: ``state`` is not a mapping from :meth:`Accumulator.state_dict`, or a field
            has the wrong type (the message names the key).
        ValueError: another format version, another ``steps``, other parameters, a missing key
            or a value out of range (named).
    """
    window = check_state_record(state, steps, param_signature(params))
    saved = state["window"]
    for name, value, numbers_ok in (("state['window']['items']", saved["items"], True),
                                    ("state['window']['scale']", saved.get("scale"), True),
                                    ("state['most_items']", state.get("most_items"), True),
                                    ("state['window_most_items']", state.get("window_most_items"), True),
                                    ("state['loss_sum']", state.get("loss_sum"), False),
                                    ("state['window_loss']", state.get("window_loss"), False)):
        _check_scalar(name, value, numbers_ok)
    for i, (p, g) in enumerate(zip(params, state["grads"], strict=True)):
        if g is None:
            continue
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"state['grads'][{i}] must be a tensor or None, got {type(g).__name__}")
        if g.shape != p.shape:
            raise ValueError(f"state['grads'][{i}] has shape {tuple(g.shape)}, its parameter "
                             f"{tuple(p.shape)}")
    return window


def _check_scalar(name: str, value: Any, numbers_ok: bool) -> None:
    """None, a 0-dim real tensor, or (``numbers_ok``) a finite number >= 0."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name} must be a 0-dim real tensor, got {value.dtype} of shape "
                             f"{tuple(value.shape)}")
        return
    if numbers_ok and isinstance(value, Real) and not isinstance(value, bool):
        if not nonneg_finite(value):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        return
    raise TypeError(f"{name} must be {'a number, ' if numbers_ok else ''}a 0-dim tensor or None, "
                    f"got {type(value).__name__}")


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
