"""Checkpointable accumulator state: the window record plus the gradients, every field checked.

``state_dict()`` is the :class:`~gradaccum.core.window.Window` record (its losses summed into
``loss_sum``) plus copies of the partial gradients. ``load_state_dict`` checks every field, the
tensors' device, layout, dtype, shape and the values of tensor-valued fields, before it changes
anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real
from typing import Any

import torch

from gradaccum.core.checkpoint import FORMAT_VERSION, check_state_record, nonneg_finite, param_signature
from gradaccum.core.schedule import Schedule
from gradaccum.core.window import Window
from gradaccum.torch._validate import MAX_EXACT_ITEMS
from gradaccum.torch._window_loss import weighted_sum

__all__ = ["FORMAT_VERSION", "check_size", "check_state", "clone_scalar", "pack_state", "restore_grads",
           "restore_window", "snapshot_grads"]


def snapshot_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Copies of the partial gradients (later micro-batches add into the live ones in place)."""
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def clone_scalar(value: Any) -> Any:
    """A copy of a tensor scalar (a number or None as it is)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def pack_state(window: Window, steps: Any, counters: dict[str, int], window_loss: torch.Tensor | None,
               params: Sequence[torch.Tensor], accum: Any) -> dict[str, Any]:
    """The accumulator's state: the window record, the counters and copies of the gradients
    (tensors copied, so later micro-batches leave it as it was)."""
    return {
        "version": FORMAT_VERSION,
        "steps": steps,
        "window": {"size": window.size, "micro_step": window.micro_step, "weighting": window.weighting,
                   "items": clone_scalar(window.items), "scale": clone_scalar(window.scale),
                   "summed": window.summed, "basis": clone_scalar(window.basis),
                   "terms": [[clone_scalar(t.total), clone_scalar(t.items), clone_scalar(t.stray), t.blocks]
                             for t in window.terms],
                   "opened_at": window.opened_at, "resized": window.opened_at is None},
        **counters,
        "loss_sum": clone_scalar(weighted_sum(window.losses)),
        "window_loss": clone_scalar(window_loss),
        "param_signature": param_signature(params),
        "grads": snapshot_grads(params),
        "accum": accum,
    }


def restore_window(state: dict[str, Any], window: Window) -> Window:
    """The checked ``window`` with its losses and, for a 0.2.0 state (no ``basis``), the basis
    its largest count gives and its loss sum brought to this version's unscaled form."""
    loss_sum = state.get("loss_sum")
    if "basis" not in state["window"]:  # 0.2.0: losses were saved times 1/N or n_i/P
        window = window._replace(basis=state.get("most_items"))
        if loss_sum is not None:
            loss_sum = loss_sum * (window.size if window.weighting == "mean" else window.scale)
    losses = () if loss_sum is None or window.empty else ((clone_scalar(loss_sum), 1),)
    return window._replace(losses=losses)


def check_state(state: Any, steps: Any, params: Sequence[torch.Tensor]) -> Window:
    """Check every field :meth:`Accumulator.load_state_dict` will use, before anything changes.

    Returns:
        The saved window (without its losses: :func:`restore_window` adds them).

    Raises:
        TypeError: ``state`` is not a mapping from :meth:`Accumulator.state_dict`, or a field
            has the wrong type (the message names the key).
        ValueError: another format version, another ``steps``, other parameters, a missing key
            or a value out of range (named): a negative, NaN or infinite count, a gradient on
            another device, sparse, of another dtype or shape.
    """
    window = check_state_record(state, steps, param_signature(params))
    saved = state["window"]
    terms = [(f"state['window']['terms'][{i}] {part}", value, True)
             for i, slot in enumerate(window.terms)
             for part, value in (("total", slot.total), ("items", slot.items), ("stray", slot.stray))]
    _check_scale(saved.get("scale"))
    _check_items(saved["items"])
    for name, value, count in (("state['window']['items']", saved["items"], True),
                               ("state['window']['scale']", saved.get("scale"), True),
                               *terms,
                               ("state['window']['basis']", saved.get("basis"), True),
                               ("state['most_items']", state.get("most_items"), True),
                               ("state['loss_sum']", state.get("loss_sum"), False),
                               ("state['window_loss']", state.get("window_loss"), False)):
        _check_scalar(name, value, count)
    for i, (p, g) in enumerate(zip(params, state["grads"], strict=True)):
        if g is not None:
            _check_grad(f"state['grads'][{i}]", p, g)
    return window


def check_size(window: Window, schedule: Schedule, state: dict[str, Any]) -> None:
    """A saved window's size is one :meth:`Accumulator.state_dict` can have written (else the
    window would never complete, or complete early): the one ``schedule`` gave when it opened
    (``opened_at``: a window keeps its size to its boundary, so the count checked is the one it
    opened at, not the saved counters: an epoch schedule's window carried into the next epoch),
    or one ``resize_window`` gave (``resized``: AutoBatch; taken as saved). A state saved before
    the count was recorded (gradaccum 0.3.0 and older: no ``opened_at``) holds the size the
    schedule gives at its saved count (an epoch schedule: at that epoch or an earlier one).

    Raises:
        TypeError: ``state['window']['resized']`` is not a bool.
        ValueError: naming the saved size, the count and what the schedule gives there.
    """
    saved = state["window"]
    resized = saved.get("resized", False)
    if not isinstance(resized, bool):
        raise TypeError(f"state['window']['resized'] must be a bool, got {resized!r}")
    at = window.opened_at
    by_epoch = schedule.by == "epoch"
    unit = "epoch" if by_epoch else "optimizer step"
    if at is not None:
        want = schedule(at)
        if window.size != want:
            raise ValueError(f"state['window']['size'] is {window.size}, but steps="
                             f"{schedule.describe()!r} gives {want} at {unit} {at}, where "
                             f"the window opened (state['window']['opened_at']): {_UNWRITTEN}")
        return
    if resized:
        return
    if "opened_at" in saved:  # this version writes None only beside resized=True
        raise ValueError(f"state['window']['size'] is {window.size} with state['window']['opened_at'] "
                         f"None and no resize recorded (state['window']['resized']): {_UNWRITTEN}")
    count = state["epoch"] if by_epoch else state["optimizer_steps"]
    if window.size not in _sizes_up_to(schedule, count, by_epoch):
        raise ValueError(f"state['window']['size'] is {window.size}, but steps={schedule.describe()!r} "
                         f"gives {schedule(count)} at {unit} {count}, the state's count (a state "
                         f"without state['window']['opened_at'], as gradaccum 0.3.0 wrote it): "
                         f"{_UNWRITTEN}")


_UNWRITTEN = ("not a state this accumulator wrote; resume from an unedited Accumulator.state_dict() (one "
              "saved at a boundary, micro_step == 0, loads whatever its window held)")
_EPOCHS_SCANNED = 10_000  # a callable epoch schedule: the epochs looked back over


def _sizes_up_to(schedule: Schedule, count: int, by_epoch: bool) -> set[int]:
    """The sizes a 0.3.0 window saved at ``count`` can have: the schedule's at ``count``; by epoch,
    also at an earlier epoch (a window carried over by ``set_epoch``)."""
    if not by_epoch:
        return {schedule(count)}
    table = schedule.table()
    if table is not None:
        return {size for start, size in zip(*table, strict=True) if start <= count}
    return {schedule(e) for e in range(count, max(-1, count - _EPOCHS_SCANNED), -1)}


def _check_scale(scale: Any) -> None:
    """A provisional total divides every gradient at the boundary: it must be > 0 (a number's
    range is checked by the core)."""
    if isinstance(scale, torch.Tensor) and scale.numel() == 1 and not scale.is_meta and \
            scale.layout == torch.strided and not scale.dtype.is_complex and not float(scale) > 0:
        raise ValueError(f"state['window']['scale'] must be > 0, got {float(scale)}")


def _check_items(items: Any) -> None:
    """A window's item total is at most 2**53: a feed refuses a larger one (``check_total``),
    beyond which the normalization would round (a device tensor's value is read here once)."""
    value = items.item() if isinstance(items, torch.Tensor) and items.numel() == 1 and not items.is_meta \
        and items.layout == torch.strided and not items.dtype.is_complex else items
    if isinstance(value, Real) and not isinstance(value, bool) and float(value) > MAX_EXACT_ITEMS:
        raise ValueError(f"state['window']['items'] is {value!r}, beyond 2**53: no feed accepts a window "
                         f"total above it; {_UNWRITTEN}")


def _check_scalar(name: str, value: Any, count: bool) -> None:
    """None, a 0-dim real tensor, or (``count``) a finite number >= 0; a count's tensor holds
    one too."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name} must be a 0-dim real tensor, got {value.dtype} of shape "
                             f"{tuple(value.shape)}")
        if value.layout != torch.strided or value.is_meta:
            raise ValueError(f"{name} must be a dense tensor with a value, got {value.layout} on "
                             f"{value.device}")
        if count and not nonneg_finite(value.item()):  # a load may read a device value once
            raise ValueError(f"{name} must be finite and >= 0, got {float(value)}")
        return
    if count and isinstance(value, Real) and not isinstance(value, bool):
        if not nonneg_finite(value):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        return
    raise TypeError(f"{name} must be {'a number, ' if count else ''}a 0-dim tensor or None, "
                    f"got {type(value).__name__}")


def _check_grad(name: str, p: torch.Tensor, g: Any) -> None:
    """A saved gradient a parameter can take: a dense, real floating tensor of its shape, on a
    device that holds values (a CPU copy loads onto the parameter's device)."""
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"{name} must be a tensor or None, got {type(g).__name__}")
    if g.shape != p.shape:
        raise ValueError(f"{name} has shape {tuple(g.shape)}, its parameter {tuple(p.shape)}")
    if g.layout != torch.strided or g.is_meta:
        raise ValueError(f"{name} must be a dense tensor with values, got {g.layout} on {g.device}")
    if not g.dtype.is_floating_point:
        raise ValueError(f"{name} has dtype {g.dtype}, its parameter {p.dtype}: a gradient is a "
                         "real floating tensor")
    if g.dtype != p.dtype:
        raise ValueError(f"{name} has dtype {g.dtype}, its parameter {p.dtype}")
    if g.device != p.device and g.device.type != "cpu":
        raise ValueError(f"{name} is on {g.device}, its parameter on {p.device}")


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
