"""The accumulator checkpoint record, shared by every backend: its version and its checks.

A backend's ``state_dict()`` holds counters, the window (size, micro-step, weighting, item
total), the ``steps`` description, a parameter signature (shape and dtype of each parameter, as
the backend writes them) and copies of the partial gradients. Before ``load_state_dict`` changes
anything, :func:`check_state_record` rejects a state from another format version, another
``steps`` or other parameters, with the same messages on every backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gradaccum.core.window import Window

__all__ = ["FORMAT_VERSION", "check_state_record", "window_from_record"]

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


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
