"""The tiled losses' arguments, checked before anything is computed: each error names the argument,
what it got and what to pass instead."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from gradaccum.contrastive._tiles import pick_tile
from gradaccum.core.validate import check_positive_int

__all__ = ["check_pair", "check_scalar", "check_tile"]


def check_tile(tile: Any, device: torch.device) -> int:
    """``tile`` as an int (``None``: :func:`~gradaccum.contrastive._tiles.pick_tile`).

    Raises:
        TypeError: not an integer (a bool or a float included).
        ValueError: zero or negative.
    """
    if tile is None:
        return pick_tile(device)
    return check_positive_int("tile", tile, fix="pass the rows and columns of one block as an int, "
                                                "such as tile=1024, or tile=None to pick one")


def _matrix(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of shape (rows, dim), got a {type(t).__name__}")
    if t.dim() != 2 or not t.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor of shape (rows, dim), one row per example, got "
                         f"a {t.dtype} tensor of shape {tuple(t.shape)}")
    if len(t) == 0:
        raise ValueError(f"{name} has no rows: the loss needs at least one pair")
    return t


def check_pair(names: tuple[str, str], a: Any, b: Any, *,
               same_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b``, checked as the loss's two matrices (rows of ``a`` scored against rows of ``b``).

    Args:
        names: the two arguments' names, for the messages.
        same_rows: ``b`` must have as many rows as ``a`` (pairs); else at least as many (keys
            after the positives).

    Raises:
        TypeError: not a tensor.
        ValueError: not 2-D floating, no rows, another width, dtype or device than the other, or
            the wrong number of rows.
    """
    (na, nb), a, b = names, _matrix(names[0], a), _matrix(names[1], b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{na} and {nb} must have the same width (dim 1): {na} is {tuple(a.shape)}, "
                         f"{nb} is {tuple(b.shape)}; project them to one embedding size")
    if a.dtype != b.dtype:
        raise ValueError(f"{na} is {a.dtype} and {nb} is {b.dtype}: cast them to one dtype (under autocast, "
                         f"e.g. both .float() or both .bfloat16())")
    if a.device != b.device:
        raise ValueError(f"{na} is on {a.device} and {nb} on {b.device}: move them to one device")
    if same_rows and len(a) != len(b):
        raise ValueError(f"{na} has {len(a)} rows and {nb} {len(b)}: row i of each is one pair, so they "
                         "must have as many rows")
    if len(b) < len(a):
        raise ValueError(f"{nb} has {len(b)} rows, fewer than the {len(a)} of {na}: row i of {nb} is the "
                         f"positive of row i of {na} (any further rows are extra negatives)")
    return a, b


def check_scalar(name: str, value: Any, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a real number or a one-element tensor) as a 0-dim tensor on ``like``'s device;
    a tensor keeps its dtype and its graph (a learnable scale gets its gradient).

    Raises:
        TypeError: neither a real number nor a tensor.
        ValueError: more than one element, another device, not floating, or not finite.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar (a number or a one-element tensor), got a tensor of "
                             f"shape {tuple(value.shape)}")
        if value.device != like.device:
            raise ValueError(f"{name} is on {value.device} and the features on {like.device}: move it to "
                             f"{like.device}")
        if not value.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {value.dtype}: pass a float")
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"{name} must be finite, got {value.item()}: a scale of inf or nan gives no "
                             "loss (clamp the learnable parameter, e.g. logit_scale to ln(100))")
        return value.reshape(())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number or a one-element tensor, got a {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    dtype = like.dtype if like.dtype.itemsize >= 4 else torch.float32
    return torch.tensor(float(value), dtype=dtype, device=like.device)
