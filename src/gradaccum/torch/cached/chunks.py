"""``gradaccum.chunks``: a batch cut into chunks of a fixed size, for ``backward_cached``."""

from __future__ import annotations

from typing import Any

from gradaccum.core.validate import check_positive_int
from gradaccum.torch.memory.split import batch_size, split_batch

__all__ = ["chunks"]


def chunks(batch: Any, size: int) -> list[Any]:
    """Split ``batch`` along dim 0 into chunks of ``size`` examples; the last may be shorter.

    Args:
        batch: a tensor, or a tuple, list or dict of tensors (nested, as for
            :func:`gradaccum.split_batch`), whose tensors share their dim 0.
        size: examples per chunk, >= 1.

    Returns:
        The chunks, each with the batch's structure (views, no copy); ``[]`` for a batch of 0
        examples.

    Raises:
        TypeError, ValueError: ``size`` is not an int >= 1, the batch holds no tensor, or its
            tensors disagree on dim 0 (or one has none).

    Example:
        >>> import torch
        >>> [c["x"].tolist() for c in chunks({"x": torch.arange(5)}, 2)]
        [[0, 1], [2, 3], [4]]
    """
    size = check_positive_int("size", size)
    total = batch_size(batch)
    if total == 0:
        return []
    sizes = [size] * (total // size) + ([total % size] if total % size else [])
    return split_batch(batch, sizes)
