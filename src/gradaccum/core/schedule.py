"""Accumulation schedules: the number of micro-batches per window, over training.

``steps`` may be a constant, a mapping ``{start: N}`` (piecewise constant, as Lightning's
``GradientAccumulationScheduler``) or a callable ``count -> N``. ``count`` is the number of
optimizer steps taken so far, or the epoch when the schedule is built with ``by="epoch"``. A
schedule is only *read* when a window opens, so a change always takes effect at a boundary.

The count is the number of optimizer steps *taken*: a window skipped for non-finite gradients
(``GradScaler``) advances neither it nor the LR scheduler, so the two stay in step. On a command
line a schedule is written ``"0:4,2:2"`` (see :func:`parse_schedule`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from typing import Any, Literal

from gradaccum.core.validate import check_nonneg_int, check_positive_int, int_example

__all__ = ["Schedule", "as_schedule", "parse_schedule"]

ScheduleUnit = Literal["optimizer_step", "epoch"]
StepsSpec = int | Mapping[int, int] | Callable[[int], int]

_A_SCHEDULE = "steps={0: 4, 100: 2}"  # what the messages show as a schedule
_WRITTEN = "write it like '4' or '0:4,2:2'"  # and as a schedule on a command line


class Schedule:
    """The window size ``N`` as a function of the optimizer step (or of the epoch).

    Args:
        spec: an int (constant N), a mapping ``{start: N}`` whose N holds from ``start`` until
            the next key (N = 1 before the smallest key, as in Lightning), or a callable.
        by: ``"optimizer_step"`` (default) or ``"epoch"``: what the keys and the callable's
            argument count.

    Attributes:
        by: what the schedule counts, as given.

    Raises:
        TypeError: ``spec`` is none of the above, or a key or value is not an integer.
        ValueError: a key is negative, a value below 1, or the mapping is empty.

    Example:
        >>> s = Schedule({0: 4, 2: 2})
        >>> [s(k) for k in range(4)]
        [4, 4, 2, 2]
    """

    def __init__(self, spec: StepsSpec, *, by: ScheduleUnit = "optimizer_step") -> None:
        if by not in ("optimizer_step", "epoch"):
            raise ValueError(f"by must be 'optimizer_step' or 'epoch', got {by!r}: pass by='epoch' for a "
                             "schedule over epochs, or leave the default")
        self.by: ScheduleUnit = by
        self._const: int | None = None
        self._starts: list[int] = []
        self._sizes: list[int] = []
        self._fn: Callable[[int], int] | None = None
        if isinstance(spec, Mapping):
            self._set_mapping(spec)
        elif callable(spec):
            self._fn = spec
        else:
            self._const = check_positive_int("steps", spec, fix=(
                f"pass the micro-batches per window as an int such as steps={int_example(spec, 1, 4)}, "
                f"or a schedule such as {_A_SCHEDULE}"))

    def _set_mapping(self, spec: Mapping[Any, Any]) -> None:
        if not spec:
            raise ValueError(f"steps must not be an empty mapping: give at least one start, e.g. "
                             f"{_A_SCHEDULE}")
        fix = f"key each window size (an int >= 1) by the int >= 0 it starts at, e.g. {_A_SCHEDULE}"
        items = sorted((check_nonneg_int("steps key", k, fix=fix), v) for k, v in spec.items())
        self._starts = [k for k, _ in items]
        self._sizes = [check_positive_int(f"steps[{k}]", v, fix=fix) for k, v in items]

    @property
    def constant(self) -> int | None:
        """The window size if it never changes, else ``None``."""
        return self._const

    def table(self) -> tuple[list[int], list[int]] | None:
        """The schedule as a step function: ``(starts, sizes)``, the first start 0.

        N is ``sizes[i]`` for counts from ``starts[i]`` up to the next start. A backend that
        cannot call Python when a window opens (a compiled MindSpore graph) looks N up in this
        table instead, so both backends read the same rule.

        Returns:
            The table, or ``None`` for a callable schedule (it has no finite table).

        Example:
            >>> Schedule({2: 4, 5: 2}).table()
            ([0, 2, 5], [1, 4, 2])
            >>> Schedule(3).table()
            ([0], [3])
        """
        if self._const is not None:
            return [0], [self._const]
        if self._fn is not None:
            return None
        if self._starts[0] == 0:
            return list(self._starts), list(self._sizes)
        # N = 1 before the smallest key (see the class docstring).
        return [0, *self._starts], [1, *self._sizes]

    def __call__(self, count: int) -> int:
        """Return N for a window that opens after ``count`` optimizer steps (or in that epoch).

        Raises:
            TypeError, ValueError: a callable schedule returned something other than an int >= 1.
        """
        if self._const is not None:
            return self._const
        if self._fn is not None:
            return check_positive_int(f"steps({count})", self._fn(count), fix=(
                "make the callable return an int >= 1 for every count, e.g. "
                "steps=lambda n: 4 if n < 100 else 2"))
        i = bisect.bisect_right(self._starts, count) - 1
        return 1 if i < 0 else self._sizes[i]

    def describe(self) -> Any:
        """A JSON-able description, stored in checkpoints to detect a changed ``steps``."""
        if self._const is not None:
            return self._const
        if self._fn is not None:
            name = getattr(self._fn, "__qualname__", type(self._fn).__name__)
            return {"callable": name, "by": self.by}
        return {"mapping": [[k, n] for k, n in zip(self._starts, self._sizes, strict=True)],
                "by": self.by}

    def __repr__(self) -> str:
        return f"Schedule({self.describe()!r})"


def as_schedule(steps: Any) -> Schedule:
    """Turn the ``steps`` argument of an accumulator into a :class:`Schedule`.

    Args:
        steps: an int, a mapping, a callable or a :class:`Schedule`.

    Returns:
        The schedule.

    Raises:
        TypeError, ValueError: ``steps`` is not a valid schedule (the message names ``steps``).

    Example:
        >>> as_schedule(2)(0)
        2
    """
    return steps if isinstance(steps, Schedule) else Schedule(steps)


def parse_schedule(text: str, *, by: ScheduleUnit = "optimizer_step") -> Schedule:
    """Parse a schedule written on a command line: ``"4"`` or ``"start:N,start:N,..."``.

    Args:
        text: a constant (``"4"``) or comma-separated ``start:N`` pairs (``"0:4,2:2"``: N = 4 for
            the first two optimizer steps, then 2). Spaces are ignored.
        by: what the starts count, as for :class:`Schedule`.

    Returns:
        The schedule.

    Raises:
        TypeError: ``text`` is not a string.
        ValueError: an entry is not ``start:N`` with integers, a start repeats, a start is
            negative or an N below 1 (the message quotes ``text`` and the faulty entry).

    Example:
        >>> s = parse_schedule("0:4, 2:2")
        >>> [s(k) for k in range(4)]
        [4, 4, 2, 2]
        >>> parse_schedule("8").constant
        8
    """
    if not isinstance(text, str):
        raise TypeError(f"steps schedule must be a string, got {text!r} ({type(text).__name__}): "
                        f"{_WRITTEN}")
    entries = [e.strip() for e in text.split(",")]
    if len(entries) == 1 and ":" not in entries[0]:
        return Schedule(_parse_int(text, entries[0], "N", minimum=1), by=by)
    mapping: dict[int, int] = {}
    for entry in entries:
        parts = [p.strip() for p in entry.split(":")]
        if len(parts) != 2:
            raise ValueError(f"steps schedule {text!r}: entry {entry!r} is not 'start:N': {_WRITTEN}")
        start = _parse_int(text, parts[0], "start", minimum=0)
        if start in mapping:
            raise ValueError(f"steps schedule {text!r}: start {start} appears twice: give each start "
                             "once, e.g. '0:4,2:2'")
        mapping[start] = _parse_int(text, parts[1], "N", minimum=1)
    return Schedule(mapping, by=by)


def _parse_int(text: str, field: str, what: str, *, minimum: int) -> int:
    try:
        value = int(field)
    except ValueError:
        raise ValueError(f"steps schedule {text!r}: {what} {field!r} is not an integer: {_WRITTEN}") from None
    if value < minimum:
        raise ValueError(f"steps schedule {text!r}: {what} must be >= {minimum}, got {value}: {_WRITTEN}")
    return value
