"""The learning rates a window's one update takes, watched from its first micro-batch to its
boundary; and the schedulers inside a ``SequentialLR`` or ``ChainedScheduler``.

A scheduler stepped (or an ``lr`` set) every micro-batch, beside the accumulator, gives the
window's update a learning rate stepped N times: a second scheduler on the optimizer, a child of
the ``SequentialLR`` given as ``scheduler=`` stepped directly. One scheduler's counter cannot see
the others, so ``Guard`` (``torch/_guards.py``) reads every group's learning rate at a window's
first micro-batch (:func:`read_rates`) and compares at its boundary (:func:`rate_change`): a
number compared, or a tensor's version (no device read). Between windows the rates are the
user's: ``ReduceLROnPlateau`` stepped when ``acc.backward()`` returns True, a scheduler chained
once per window, an ``lr`` set by hand. The children of ``scheduler=`` are counted like it
(:func:`child_counts`, :func:`child_stepped`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["child_counts", "child_stepped", "rate_change", "read_rates", "schedule_count"]


def schedule_count(scheduler: Any) -> int | None:
    """An LR scheduler's ``last_epoch`` (Accelerate's wrapper: the wrapped one's), or None."""
    count = getattr(getattr(scheduler, "scheduler", scheduler), "last_epoch", None)
    return count if type(count) is int else None


def _children(scheduler: Any) -> list[Any]:
    inner = getattr(scheduler, "scheduler", scheduler)
    found = []
    for child in getattr(inner, "_schedulers", None) or ():
        found += [child, *_children(child)]
    return found


def child_counts(scheduler: Any) -> list[tuple[Any, int]]:
    """``(child, last_epoch)`` of every scheduler a ``SequentialLR`` or ``ChainedScheduler``
    steps (nested ones included); empty for any other scheduler."""
    return [(s, n) for s in _children(scheduler) if (n := schedule_count(s)) is not None]


def child_stepped(scheduler: Any, counts: list[tuple[Any, int]], then: str) -> str | None:
    """The refusal when a child of ``scheduler`` moved past its count in ``counts`` (stepped
    directly: the outer count did not move), else None."""
    for child, seen in counts:
        now = schedule_count(child)
        if now is not None and now > seen:
            return (f"{type(child).__name__}.step() was called outside the accumulator on a child of the "
                    f"{type(scheduler).__name__} given as scheduler=: its last_epoch is {now}, the "
                    f"accumulator's step left it at {seen}, so the learning rate is {now - seen} step(s) "
                    "ahead. The accumulator steps the scheduler= (and through it its children) once per "
                    f"optimizer step: remove your own step() of its children; {then}")
    return None


def read_rates(optimizer: Any) -> list[Any]:
    """Each group's learning rate: a number, or a tensor with its version (no device read)."""
    return [(lr, lr._version) if isinstance(lr := g.get("lr"), torch.Tensor) else lr
            for g in optimizer.param_groups]


def rate_change(was: list[Any], optimizer: Any, then: str) -> str | None:
    """The refusal when a group's learning rate is no longer ``was`` (:func:`read_rates` at the
    window's first micro-batch), else None. A group added since is not compared (the boundary
    refuses a group added inside a window with gradients: ``torch/_param_groups.py``)."""
    now = read_rates(optimizer)
    for i, (a, b) in enumerate(zip(was, now, strict=False)):
        if _same(a, b):
            continue
        return (f"the learning rate of parameter group {i} changed inside the window, from {_value(a)} at "
                f"its first micro-batch to {_value(b)} at its boundary: a scheduler.step() (or an lr "
                "set) every micro-batch, such as a second scheduler on this optimizer or a child of a "
                "SequentialLR stepped directly. The window's one update takes one learning rate: step "
                "schedulers (or set lr) when acc.backward() returns True, or give the one scheduler as "
                f"Accumulator(..., scheduler=); {then}")
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and a[0] is b[0] and a[1] == b[1]
    return bool(a == b)


def _value(rate: Any) -> Any:
    return float(rate[0]) if isinstance(rate, tuple) else rate
