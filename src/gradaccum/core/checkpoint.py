"""The accumulator checkpoint record, shared by every backend: its version and its checks.

A backend's ``state_dict()`` holds counters, the window (size, micro-step, weighting, item
total), the ``steps`` description, a parameter signature (shape and dtype of each parameter, as
the backend writes them) and copies of the partial gradients. Before ``load_state_dict`` changes
anything, :func:`check_state_record` rejects a state from another format version, another
``steps`` or other parameters, with the same messages on every backend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

from gradaccum.core.errors import check_nonneg_int, check_positive_int
from gradaccum.core.window import Window

__all__ = ["FORMAT_VERSION", "check_optional_number", "check_record_keys", "check_state_record",
           "check_window_record", "window_from_record"]

FORMAT_VERSION = 1


def check_state_record(state: Any, steps: Any, signature: Sequence[Any]) -> None:
    """Check that ``state`` came from an accumulator like this one.

    Args:
        state: what the caller wants to load.
        steps: this accumulator's ``Schedule.describe()``.
        signature: this accumulator's parameter signature (one ``[shape, dtype]`` per parameter).

    Raises:
        TypeError: ``state`` is not a mapping from ``Accumulator.state_dict()``.
        ValueError: another format version, another ``steps``, or other parameters.

    Example:
        >>> ok = {"version": 1, "steps": 2, "window": {}, "param_signature": [[[3], "f32"]],
        ...       "grads": [None]}
        >>> check_state_record(ok, 2, [[[3], "f32"]])
        >>> check_state_record(ok, 4, [[[3], "f32"]])
        Traceback (most recent call last):
        ...
        ValueError: state was saved with steps=2, this accumulator has steps=4
    """
    if not isinstance(state, Mapping) or "grads" not in state or "window" not in state:
        raise TypeError(f"state must be a dict from Accumulator.state_dict(), got {type(state).__name__}")
    if state.get("version") != FORMAT_VERSION:
        raise ValueError(f"state has format version {state.get('version')!r}, expected {FORMAT_VERSION}")
    if state["steps"] != steps:
        raise ValueError(
            f"state was saved with steps={state['steps']!r}, this accumulator has steps={steps!r}"
        )
    saved, ours = list(state["param_signature"]), list(signature)
    if saved != ours:
        where = "" if len(saved) != len(ours) else (
            f"; first difference at parameter {_first_difference(saved, ours)}")
        raise ValueError(
            f"state was saved for other parameters: {len(saved)} saved, {len(ours)} here{where}"
        )
    grads = state["grads"]
    if len(grads) != len(ours):
        raise ValueError(f"state holds {len(grads)} gradients for {len(ours)} parameters")


def window_from_record(w: Mapping[str, Any]) -> Window:
    """The window saved in a state's ``"window"`` entry, its size validated.

    Raises:
        TypeError, ValueError: a size that is not an integer >= 1 (the message names ``steps``).

    Example:
        >>> window_from_record({"size": 4, "micro_step": 1, "weighting": "mean", "items": 0})
        Window(size=4, micro_step=1, weighting='mean', items=0)
    """
    return Window(Window.open(w["size"]).size, w["micro_step"], w["weighting"], w["items"])


def check_record_keys(state: Any, keys: Sequence[str], name: str = "state") -> Mapping[str, Any]:
    """Return ``state`` if it is a mapping that holds every key of ``keys``.

    Args:
        state: the record.
        keys: the keys it must hold.
        name: how messages name it (``"state['window']"`` for the window entry).

    Raises:
        TypeError: ``state`` is not a mapping.
        ValueError: a key is missing (the message names it).

    Example:
        >>> check_record_keys({"epoch": 0}, ["epoch", "optimizer_steps"])
        Traceback (most recent call last):
        ...
        ValueError: state['optimizer_steps'] is missing: not a complete Accumulator.state_dict()
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"{name} must be a dict from Accumulator.state_dict(), got {type(state).__name__}")
    for key in keys:
        if key not in state:
            raise ValueError(f"{name}[{key!r}] is missing: not a complete Accumulator.state_dict()")
    return state


def check_window_record(w: Any) -> Window:
    """The saved window (a state's ``"window"`` entry) with every field checked.

    ``size`` an integer >= 1; ``0 <= micro_step < size``; ``weighting`` ``None`` exactly when the
    window is empty, else ``"mean"`` or ``"items"``; ``items`` a finite number >= 0, 0 unless the
    weighting is ``"items"``, then > 0. A backend passes a framework scalar as a plain number.

    Raises:
        TypeError, ValueError: the first bad field, named as ``state['window'][...]``.

    Example:
        >>> check_window_record({"size": 4, "micro_step": 2, "weighting": "items", "items": 9})
        Window(size=4, micro_step=2, weighting='items', items=9)
        >>> check_window_record({"size": 4, "micro_step": 4, "weighting": "mean", "items": 0})
        Traceback (most recent call last):
        ...
        ValueError: state['window']['micro_step'] must be in [0, 4) (the window's size), got 4
    """
    w = check_record_keys(w, ("size", "micro_step", "weighting", "items"), "state['window']")
    size = check_positive_int("state['window']['size']", w["size"])
    micro = check_nonneg_int("state['window']['micro_step']", w["micro_step"])
    if micro >= size:
        raise ValueError(f"state['window']['micro_step'] must be in [0, {size}) (the window's size), "
                         f"got {micro}")
    weighting, items = w["weighting"], w["items"]
    if weighting not in (None, "mean", "items"):
        raise ValueError(f"state['window']['weighting'] must be None, 'mean' or 'items', got {weighting!r}")
    if (weighting is None) != (micro == 0):
        raise ValueError(f"state['window']['weighting'] is {weighting!r} for a window of {micro} "
                         "micro-batch(es): None exactly when the window is empty")
    if isinstance(items, bool) or not isinstance(items, Real):
        raise TypeError(f"state['window']['items'] must be a number, got {items!r} ({type(items).__name__})")
    if not math.isfinite(items) or float(items) < 0:
        raise ValueError(f"state['window']['items'] must be a finite number >= 0, got {items!r}")
    if (float(items) > 0) != (weighting == "items"):
        raise ValueError(f"state['window']['items'] is {items!r} for weighting={weighting!r}: an item "
                         "total > 0 belongs to an item-weighted window, 0 to any other")
    return Window(size, micro, weighting, items)


def check_optional_number(state: Mapping[str, Any], key: str) -> float | None:
    """``state[key]`` as a float, or ``None`` when absent or ``None`` (a loss: NaN and inf pass).

    Raises:
        TypeError: anything but a real number (bools and strings included).

    Example:
        >>> check_optional_number({"window_loss": 2}, "window_loss")
        2.0
    """
    value = state.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"state[{key!r}] must be a number or None, got {value!r} ({type(value).__name__})")
    return float(value)


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
