"""Splitting a batch (a tensor, or a tuple, list or dict of them) into micro-batches along dim 0."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["batch_size", "split_batch"]


def _sizes(batch: Any, out: list[int]) -> None:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ValueError("batch holds a 0-dim tensor: there is no batch dimension to split")
        out.append(batch.shape[0])
    elif isinstance(batch, Mapping):
        for value in batch.values():
            _sizes(value, out)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            _sizes(value, out)


def batch_size(batch: Any) -> int:
    """The number of items of a batch: the common size of dim 0 of all its tensors.

    Tensors may sit in tuples, lists and dicts, nested; other values (strings, numbers, None) are
    not counted and are passed whole to every micro-batch.

    Raises:
        TypeError: the batch holds no tensor.
        ValueError: its tensors disagree on dim 0, or one has no dim 0.

    Example:
        >>> batch_size({"x": torch.zeros(5, 3), "y": torch.zeros(5), "name": "train"})
        5
    """
    sizes: list[int] = []
    _sizes(batch, sizes)
    if not sizes:
        raise TypeError(f"batch must be a tensor or a tuple/list/dict of tensors, got {type(batch).__name__}")
    if len(set(sizes)) > 1:
        raise ValueError(f"the tensors of batch disagree on their first dimension: sizes {sizes}")
    return sizes[0]


def _split(batch: Any, sizes: Sequence[int]) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        return list(torch.split(batch, list(sizes)))
    if isinstance(batch, Mapping):
        parts = {k: _split(v, sizes) for k, v in batch.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(len(sizes))]
    if isinstance(batch, (tuple, list)):
        columns = [_split(v, sizes) for v in batch]
        rows = [[c[i] for c in columns] for i in range(len(sizes))]
        if isinstance(batch, list):
            return rows
        if hasattr(batch, "_fields"):  # a namedtuple is rebuilt field by field
            return [type(batch)(*row) for row in rows]
        return [tuple(row) for row in rows]
    return [batch] * len(sizes)


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Split ``batch`` along dim 0 into micro-batches of ``sizes`` items (views, no copy).

    Args:
        batch: a tensor, or a tuple, list, namedtuple or mapping of tensors (nested); a mapping's
            micro-batches are plain dicts.
        sizes: items per micro-batch, summing to the batch's size (see
            :func:`gradaccum.split_sizes`).

    Returns:
        One micro-batch per size, each with the batch's structure.

    Raises:
        TypeError, ValueError: the batch has no tensor, its tensors disagree on dim 0, or the
            sizes do not sum to it.

    Example:
        >>> x, y = torch.arange(5), torch.arange(5) * 10
        >>> [mb[1].tolist() for mb in split_batch((x, y), [2, 2, 1])]
        [[0, 10], [20, 30], [40]]
    """
    total = batch_size(batch)
    if sum(sizes) != total or any(s < 1 for s in sizes):
        raise ValueError(f"sizes {list(sizes)} must be >= 1 and sum to the batch size {total}")
    return _split(batch, sizes)
