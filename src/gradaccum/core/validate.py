"""Validation helpers shared by every backend.

Each helper checks one argument and raises a ``TypeError`` (wrong kind of value) or a
``ValueError`` (right kind, wrong value) whose message names the argument and shows the value
it got, so that a user reading the traceback knows what to change. They never mutate anything:
callers validate first, then change state.
"""

from __future__ import annotations

import math
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


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` as an ``int`` if it is an integer >= 1.

    Args:
        name: the argument's name, used in the message.
        value: the value to check.

    Returns:
        ``int(value)``.

    Raises:
        TypeError: ``value`` is not an integer (floats, strings, bools and None included).
        ValueError: ``value`` is an integer below 1.

    Example:
        >>> check_positive_int("steps", 4)
        4
    """
    if not _is_int(value):
        raise TypeError(f"{name} must be a positive integer, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer (>= 1), got {value!r}")
    return int(value)


def check_nonneg_int(name: str, value: Any) -> int:
    """Return ``value`` as an ``int`` if it is an integer >= 0.

    Args:
        name: the argument's name, used in the message.
        value: the value to check.

    Returns:
        ``int(value)``.

    Raises:
        TypeError: ``value`` is not an integer.
        ValueError: ``value`` is negative.

    Example:
        >>> check_nonneg_int("micro_step", 0)
        0
    """
    if not _is_int(value):
        raise TypeError(f"{name} must be a non-negative integer, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def check_positive_float(name: str, value: Any) -> float:
    """Return ``value`` as a ``float`` if it is a finite real number > 0.

    Args:
        name: the argument's name, used in the message.
        value: the value to check.

    Returns:
        ``float(value)``.

    Raises:
        TypeError: ``value`` is not a real number (bools and strings included).
        ValueError: ``value`` is <= 0, NaN or infinite.

    Example:
        >>> check_positive_float("clip_norm", 1)
        1.0
    """
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a positive number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_optional_positive_float(name: str, value: Any) -> float | None:
    """Like :func:`check_positive_float`, but ``None`` passes through (the feature is off).

    Example:
        >>> check_optional_positive_float("clip_norm", None) is None
        True
    """
    return None if value is None else check_positive_float(name, value)
