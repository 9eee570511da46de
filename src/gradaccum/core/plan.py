"""Batch arithmetic: global batch = micro-batch x steps x world size, splits, LR scaling."""

from __future__ import annotations

import math
from typing import Literal

from gradaccum.core.validate import check_positive_float, check_positive_int

__all__ = ["check_batch_sizes", "lr_scale", "resolve_batch_sizes", "split_sizes"]


def lr_scale(
    base_lr: float, base_batch: int, batch: int, rule: Literal["linear", "sqrt"] = "linear"
) -> float:
    """Scale a learning rate tuned at ``base_batch`` to an effective batch of ``batch``.

    Both seed documents advise raising the learning rate with the effective batch. ``"linear"``
    (Goyal et al., for SGD) multiplies by ``batch / base_batch``; ``"sqrt"`` (often used with
    Adam) by its square root.

    Args:
        base_lr: the learning rate that works at ``base_batch``.
        base_batch: the batch size ``base_lr`` was tuned for.
        batch: the new effective batch (micro-batch x steps x world size).
        rule: ``"linear"`` or ``"sqrt"``.

    Returns:
        The scaled learning rate.

    Raises:
        TypeError, ValueError: a non-positive or non-numeric argument, or an unknown rule.

    Example:
        >>> lr_scale(0.01, 32, 64)
        0.02
        >>> round(lr_scale(0.01, 32, 128, rule="sqrt"), 6)
        0.02
    """
    lr = check_positive_float("base_lr", base_lr)
    ratio = check_positive_int("batch", batch) / check_positive_int("base_batch", base_batch)
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    raise ValueError(f"rule must be 'linear' or 'sqrt', got {rule!r}")


def check_batch_sizes(global_batch: int, micro_batch: int, steps: int, world_size: int = 1) -> None:
    """Check that ``global_batch == micro_batch * steps * world_size``.

    Raises:
        ValueError: they disagree; the message shows all four numbers.

    Example:
        >>> check_batch_sizes(64, 32, 2)
        >>> check_batch_sizes(64, 16, 2, 2)
    """
    g = check_positive_int("global_batch", global_batch)
    m = check_positive_int("micro_batch", micro_batch)
    s = check_positive_int("steps", steps)
    w = check_positive_int("world_size", world_size)
    if m * s * w != g:
        raise ValueError(
            f"global batch {g} != micro_batch {m} x steps {s} x world_size {w} (= {m * s * w})"
        )


def resolve_batch_sizes(
    micro_batch: int | None, steps: int | None, global_batch: int | None, world_size: int = 1
) -> tuple[int, int]:
    """Complete (micro_batch, steps) from any two of micro-batch, steps and global batch.

    Returns:
        ``(micro_batch, steps)``.

    Raises:
        ValueError: fewer than two are given, the three disagree, or the global batch does not
            divide evenly.

    Example:
        >>> resolve_batch_sizes(None, 2, 64)
        (32, 2)
        >>> resolve_batch_sizes(8, None, 64, world_size=2)
        (8, 4)
    """
    w = check_positive_int("world_size", world_size)
    if micro_batch is not None and steps is not None:
        if global_batch is not None:
            check_batch_sizes(global_batch, micro_batch, steps, w)
        return check_positive_int("micro_batch", micro_batch), check_positive_int("steps", steps)
    if global_batch is None:
        raise ValueError("give two of micro_batch, steps and global_batch")
    g = check_positive_int("global_batch", global_batch)
    known = micro_batch if micro_batch is not None else steps
    if known is None:
        raise ValueError(f"global_batch={g} needs micro_batch or steps beside it")
    k = check_positive_int("micro_batch" if micro_batch is not None else "steps", known)
    if g % (k * w):
        raise ValueError(f"global batch {g} is not divisible by {k} x world_size {w}")
    other = g // (k * w)
    return (k, other) if micro_batch is not None else (other, k)


def split_sizes(total: int, micro_batch: int) -> list[int]:
    """Sizes of the micro-batches that split ``total`` items into chunks of ``micro_batch``.

    The last one is smaller when ``micro_batch`` does not divide ``total``.

    Example:
        >>> split_sizes(10, 4)
        [4, 4, 2]
    """
    t = check_positive_int("total", total)
    m = check_positive_int("micro_batch", micro_batch)
    return [min(m, t - i) for i in range(0, t, m)]
