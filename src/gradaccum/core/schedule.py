"""Accumulation schedules: the number of micro-batches per window, over training.

``steps`` may be a constant, a mapping ``{start: N}`` (piecewise constant, as Lightning's
``GradientAccumulationScheduler``) or a callable ``count -> N``. ``count`` is the number of
optimizer steps taken so far, or the epoch when the schedule is built with ``by="epoch"``. A
schedule is only *read* when a window opens, so a change always takes effect at a boundary.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from typing import Any, Literal

from gradaccum.core.errors import check_nonneg_int, check_positive_int

__all__ = ["Schedule", "as_schedule"]

ScheduleUnit = Literal["optimizer_step", "epoch"]
StepsSpec = int | Mapping[int, int] | Callable[[int], int]


class Schedule:
    """The window size ``N`` as a function of the optimizer step (or of the epoch).

    Args:
        spec: an int (constant N), a mapping ``{start: N}`` whose N holds from ``start`` until
            the next key (N = 1 before the smallest key, as in Lightning), or a callable.
        by: ``"optimizer_step"`` (default) or ``"epoch"``: what the keys and the callable's
            argument count.

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
            raise ValueError(f"by must be 'optimizer_step' or 'epoch', got {by!r}")
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
            self._const = check_positive_int("steps", spec)

    def _set_mapping(self, spec: Mapping[Any, Any]) -> None:
        if not spec:
            raise ValueError("steps must not be an empty mapping")
        items = sorted((check_nonneg_int("steps key", k), v) for k, v in spec.items())
        self._starts = [k for k, _ in items]
        self._sizes = [check_positive_int(f"steps[{k}]", v) for k, v in items]

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
            return check_positive_int(f"steps({count})", self._fn(count))
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
