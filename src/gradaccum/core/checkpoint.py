"""The accumulator checkpoint record, shared by every backend: its version and its checks.

A backend's ``state_dict()`` holds counters, the window (size, micro-step, weighting, item
total), the ``steps`` description, a parameter signature (shape and dtype of each parameter) and
copies of the partial gradients. Before ``load_state_dict`` changes anything,
:func:`check_state_record` checks every framework-free field it will use, with the same messages
on every backend: a corrupted or foreign state raises ``TypeError``/``ValueError`` naming the key,
and the accumulator is left as it was.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from numbers import Real
from typing import Any

from gradaccum.core.terms import TermSlot
from gradaccum.core.validate import check_nonneg_int, check_positive_int
from gradaccum.core.window import Window

__all__ = ["COUNTERS", "FORMAT_VERSION", "check_optional_number", "check_record_keys", "check_state_record",
           "nonneg_finite", "param_signature", "window_from_record"]

FORMAT_VERSION = 1
COUNTERS = ("optimizer_steps", "skipped_windows", "epoch")
_WEIGHTINGS = (None, "mean", "items")


def param_signature(params: Iterable[Any]) -> list[list[Any]]:
    """Shape and dtype of every parameter (any framework's tensors), to recognize a state saved
    for other parameters.

    Example:
        >>> class P:
        ...     shape, dtype = (2, 3), "float32"
        >>> param_signature([P()])
        [[[2, 3], 'float32']]
    """
    return [[list(p.shape), str(p.dtype)] for p in params]


def check_state_record(state: Any, steps: Any, signature: Sequence[Any],
                       counters: Sequence[str] = COUNTERS) -> Window:
    """Check that ``state`` came from an accumulator like this one, and that it is whole.

    Args:
        state: what the caller wants to load.
        steps: this accumulator's ``Schedule.describe()``.
        signature: this accumulator's :func:`param_signature`.
        counters: the keys that must hold integers >= 0.

    Returns:
        The saved window (item total as saved: a backend checks a framework scalar itself).

    Raises:
        TypeError: ``state`` is not a mapping, or a field has the wrong type (named).
        ValueError: a missing key, another format version, another ``steps``, other parameters,
            or a field out of range (named).

    Example:
        >>> ok = {"version": 1, "steps": 2, "param_signature": [[[3], "f32"]], "grads": [None],
        ...       "window": {"size": 2, "micro_step": 0, "weighting": None, "items": 0},
        ...       "optimizer_steps": 0, "skipped_windows": 0, "epoch": 0}
        >>> check_state_record(ok, 2, [[[3], "f32"]]).size
        2
        >>> check_state_record({**ok, "optimizer_steps": -5}, 2, [[[3], "f32"]])
        Traceback (most recent call last):
        ...
        ValueError: state['optimizer_steps'] must be a non-negative integer, got -5: the state is damaged
        or not an accumulator's; load the dict that state_dict() returned, unedited
    """
    if not isinstance(state, Mapping) or "grads" not in state or "window" not in state:
        raise TypeError(f"state must be a dict from Accumulator.state_dict(), got {type(state).__name__}: "
                        "pass the dict that state_dict() returned")
    check_record_keys(state, ("version", "steps", "param_signature", *counters))
    if state["version"] != FORMAT_VERSION:
        raise ValueError(f"state has format version {state['version']!r}, expected {FORMAT_VERSION}")
    if state["steps"] != steps:
        raise ValueError(
            f"state was saved with steps={state['steps']!r}, this accumulator has steps={steps!r}: "
            f"build the Accumulator with steps={state['steps']!r} to resume it (to change N from "
            "then on, give a schedule, e.g. steps={0: old, K: new}, in both runs)")
    _check_signature(state["param_signature"], signature)
    grads = state["grads"]
    if not isinstance(grads, (list, tuple)):
        raise TypeError(f"state['grads'] must be a list, got {type(grads).__name__}")
    if len(grads) != len(signature):
        raise ValueError(f"state['grads'] holds {len(grads)} gradients for {len(signature)} parameters")
    for key in counters:
        check_nonneg_int(f"state[{key!r}]", state[key])
    return window_from_record(state["window"])


def window_from_record(w: Any) -> Window:
    """The window saved in a state's ``"window"`` entry, every field checked.

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range (named), or fields that
            contradict each other (an empty window with a weighting, a mean window with items).

    Example:
        >>> window_from_record({"size": 4, "micro_step": 1, "weighting": "mean", "items": 0}).micro_step
        1
    """
    check_record_keys(w, ("size", "micro_step", "weighting", "items"), "state['window']")
    size = check_positive_int("state['window']['size']", w["size"])
    micro = check_nonneg_int("state['window']['micro_step']", w["micro_step"])
    if micro >= size:
        raise ValueError(f"state['window']['micro_step'] must be in [0, {size}) for a window of "
                         f"{size}, got {micro}: the state is damaged; load the dict that state_dict() "
                         "returned, unedited")
    weighting = w["weighting"]
    if weighting not in _WEIGHTINGS:
        raise ValueError(f"state['window']['weighting'] must be None, 'mean' or 'items', got {weighting!r}")
    if (weighting is None) != (micro == 0):
        raise ValueError(f"state['window']['weighting'] is {weighting!r} for a window of {micro} "
                         "micro-batch(es): None exactly when the window is empty")
    items = w["items"]
    summed = w.get("summed", False)
    if not isinstance(summed, bool):
        raise TypeError(f"state['window']['summed'] must be a bool, got {summed!r}")
    if isinstance(items, (bool, str)):
        raise TypeError(f"state['window']['items'] must be a number, got {items!r}")
    if isinstance(items, Real):
        if not nonneg_finite(items):
            raise ValueError(f"state['window']['items'] must be a finite number >= 0, got {items!r}")
        # Only a window of summed losses may hold no item yet; any other holds none or some.
        if (weighting == "items" and items == 0 and not summed) or (weighting != "items" and items != 0):
            raise ValueError(f"state['window']['items'] is {items!r} for weighting={weighting!r}: an "
                             "item total > 0 belongs to an item-weighted window, 0 to any other")
    scale = w.get("scale")
    if isinstance(scale, (bool, str)) or (
            isinstance(scale, Real) and not (nonneg_finite(scale) and float(scale) > 0)):
        raise ValueError(f"state['window']['scale'] must be None or a number > 0, got {scale!r}")
    basis = w.get("basis")
    if isinstance(basis, (bool, str)) or (isinstance(basis, Real) and not nonneg_finite(basis)):
        raise ValueError(f"state['window']['basis'] must be None or a finite number >= 0, got {basis!r}")
    # Where the size came from: the count the schedule gave it at, or None (resized, or a state
    # written before it was recorded: its size is taken as saved).
    opened_at = w.get("opened_at")
    if opened_at is not None:
        check_nonneg_int("state['window']['opened_at']", opened_at)
    return Window(size, micro, weighting, items, scale, summed, basis, terms=_terms_from_record(w, micro),
                  opened_at=opened_at)


def _terms_from_record(w: Any, micro: int) -> tuple[TermSlot, ...]:
    """The saved ``mb.term`` slots (none in a state saved before they were recorded)."""
    saved = w.get("terms", ())
    if not isinstance(saved, (list, tuple)):
        raise TypeError(f"state['window']['terms'] must be a list, got {type(saved).__name__}")
    if saved and w["weighting"] != "mean":
        raise ValueError("state['window']['terms'] belong to a window without n_items, this one has "
                         f"weighting={w['weighting']!r}")
    slots = []
    for i, slot in enumerate(saved):
        name = f"state['window']['terms'][{i}]"
        if not isinstance(slot, (list, tuple)) or len(slot) != 4:
            raise TypeError(f"{name} must be [total, items, stray, blocks], got {slot!r}")
        total, items, stray, blocks = slot
        for part, value, optional in (("total", total, False), ("items", items, True),
                                      ("stray", stray, False)):
            if value is None and optional:
                continue
            if isinstance(value, (bool, str)) or value is None or (
                    isinstance(value, Real) and not nonneg_finite(value)):
                raise ValueError(f"{name} {part} must be a finite number >= 0, got {value!r}")
        if isinstance(total, Real) and float(total) <= 0:
            raise ValueError(f"{name} total must be > 0, got {total!r}")
        check_positive_int(f"{name} blocks", blocks)
        if blocks > micro:
            raise ValueError(f"{name} counts {blocks} blocks in a window of {micro} micro-batch(es)")
        slots.append(TermSlot(total, items, stray, blocks))
    return tuple(slots)


def _check_signature(saved: Any, ours: Sequence[Any]) -> None:
    if not isinstance(saved, (list, tuple)):
        raise TypeError(f"state['param_signature'] must be a list, got {type(saved).__name__}")
    saved, ours = list(saved), list(ours)
    if saved != ours:
        where = "" if len(saved) != len(ours) else (
            f"; first difference at parameter {_first_difference(saved, ours)}")
        raise ValueError(
            f"state was saved for other parameters: {len(saved)} saved, {len(ours)} here{where}: load it "
            "into an accumulator whose optimizer holds the saved model's parameters, in the same order")


def nonneg_finite(x: Real | float) -> bool:
    """``x`` is a finite number >= 0 (a saved count or scale)."""
    return math.isfinite(float(x)) and float(x) >= 0


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


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
