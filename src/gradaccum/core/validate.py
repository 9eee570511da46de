"""Validation helpers shared by every backend.

Each helper checks one argument and raises a ``TypeError`` (wrong kind of value) or a
``ValueError`` (right kind, wrong value) whose message names the argument, shows the value it
got and says what to pass instead (a caller may word that fix itself: ``fix=``), so that a user
reading the traceback knows what to change. They never mutate anything: callers validate first,
then change state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Integral, Real
from typing import Any

__all__ = [
    "check_nonneg_int",
    "check_optional_positive_float",
    "check_positive_float",
    "check_positive_int",
]


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but ``steps=True`` is a mistake, never a count.
    return isinstance(value, Integral) and not isinstance(value, bool)


def _number(value: Any) -> float | None:
    """What ``value`` was meant to be as a finite number (``2.5``, ``"2"``), or None."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        return None
    return float(value)


def int_example(value: Any, minimum: int, default: int | None = None) -> int:
    """An int to suggest in place of ``value``: its integer part (``2.5`` and ``"2"`` give 2),
    raised to ``minimum``; ``default`` (else ``minimum``) where it is no number at all.

    Example:
        >>> int_example(2.5, 1), int_example(0, 1), int_example(None, 1, default=4)
        (2, 1, 4)
    """
    number = _number(value)
    if number is None:
        return minimum if default is None else default
    return max(minimum, int(number))


def _default_fix(name: str, kind: str, example: Any) -> str:
    """What to do, where the caller did not say: pass ``kind`` such as ``name=example``; for a
    field of a saved state (``state['epoch']``), load the state as it was written."""
    if name.startswith("state["):
        return ("the state is damaged or not an accumulator's; load the dict that state_dict() "
                "returned, unedited")
    return f"pass {kind} such as {name + '=' if name.isidentifier() else ''}{example!r}"


def check_positive_int(name: str, value: Any, *, fix: str | None = None) -> int:
    """Return ``value`` as an ``int`` if it is an integer >= 1.

    Args:
        name: the argument's name, used in the message.
        value: the value to check.
        fix: what the message tells the user to do; by default to pass an int, the nearest to
            ``value`` (``steps=2`` for ``2.5`` or ``"2"``).

    Returns:
        ``int(value)``.

    Raises:
        TypeError: ``value`` is not an integer (floats, strings, bools and None included).
        ValueError: ``value`` is an integer below 1.

    Example:
        >>> check_positive_int("steps", 4)
        4
    """
    return _check_int(name, value, 1, fix)


def check_nonneg_int(name: str, value: Any, *, fix: str | None = None) -> int:
    """Return ``value`` as an ``int`` if it is an integer >= 0.

    Args:
        name: the argument's name, used in the message.
        value: the value to check.
        fix: what the message tells the user to do; by default to pass an int, the nearest to
            ``value``.

    Returns:
        ``int(value)``.

    Raises:
        TypeError: ``value`` is not an integer.
        ValueError: ``value`` is negative.

    Example:
        >>> check_nonneg_int("micro_step", 0)
        0
    """
    return _check_int(name, value, 0, fix)


def _check_int(name: str, value: Any, least: int, fix: str | None) -> int:
    """``value`` as an ``int`` if it is an integer >= ``least`` (1: positive, 0: non-negative)."""
    if _is_int(value) and value >= least:
        return int(value)
    kind = "a positive integer" if least == 1 else "a non-negative integer"
    fix = fix or _default_fix(name, "an int", int_example(value, least))  # worded only for an error
    if not _is_int(value):
        raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__}): {fix}")
    raise ValueError(f"{name} must be {kind}{' (>= 1)' if least == 1 else ''}, got {value!r}: {fix}")


def check_positive_float(name: str, value: Any, *, fix: str | None = None) -> float:
    """Return ``value`` as a ``float`` if it is a finite real number > 0.

    Args:
        name: the argument's name, used in the message.
        value: the value to check.
        fix: what the message tells the user to do; by default to pass a number, ``value`` as
            one where it reads as a positive number (``"1"`` gives ``name=1.0``), else 1.0.

    Returns:
        ``float(value)``.

    Raises:
        TypeError: ``value`` is not a real number (bools and strings included).
        ValueError: ``value`` is <= 0, NaN or infinite.

    Example:
        >>> check_positive_float("clip_norm", 1)
        1.0
    """
    return _positive_float(name, value, lambda: fix or _default_fix(name, "a number", _float_example(value)))


def check_optional_positive_float(name: str, value: Any, *, fix: str | None = None) -> float | None:
    """Like :func:`check_positive_float`, but ``None`` passes through (the feature is off); the
    message's default fix names ``name=None`` too.

    Example:
        >>> check_optional_positive_float("clip_norm", None) is None
        True
    """
    if value is None:
        return None
    return _positive_float(name, value, lambda: fix or (
        f"pass a number such as {name}={_float_example(value)!r}, or {name}=None to turn it off"))


def _float_example(value: Any) -> float:
    """``value`` as the positive number it was meant to be (``"1"`` gives 1.0), else 1.0."""
    number = _number(value)
    return number if number is not None and number > 0 else 1.0


def _positive_float(name: str, value: Any, fix: Callable[[], str]) -> float:
    """``value`` as a ``float`` if it is a finite real number > 0; ``fix()`` words the error's fix
    (only when there is one)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a positive number, got {value!r} ({type(value).__name__}): {fix()}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}: {fix()}")
    return float(value)
