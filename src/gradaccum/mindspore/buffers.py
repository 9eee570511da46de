"""Per-buffer operations of the MindSpore accumulator, applied by ``ops.HyperMap``.

They live at module level because HyperMap takes no closures, and use plain ``assign`` and
``assign_add``: MindSpore's in-place Tensor methods have no CPU kernels. The buffer is never
zeroed: a window's first micro-batch overwrites it (``set_``). That saves a pass per window,
cannot leave a NaN behind, and avoids ``ops.zeros_like``, which a compiled graph turns into a
resident parameter-sized constant: the tutorial's zeros copy again (measured in docs/MINDSPORE.md).
"""

from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, ops

__all__ = ["add_", "add_weighted_", "scale_", "set_", "set_weighted_", "square_sum"]


def set_(buf: Tensor, grad: Tensor) -> Tensor:
    """Overwrite the buffer with a window's first gradient."""
    return ops.assign(buf, grad)


def add_(buf: Tensor, grad: Tensor) -> Tensor:
    """Add a later micro-batch's gradient."""
    return ops.assign_add(buf, grad)


def set_weighted_(weight: Tensor, buf: Tensor, grad: Tensor) -> Tensor:
    """:func:`set_` of ``n_items x grad`` (item weighting)."""
    return ops.assign(buf, grad * weight.astype(grad.dtype))


def add_weighted_(weight: Tensor, buf: Tensor, grad: Tensor) -> Tensor:
    """:func:`add_` of ``n_items x grad`` (item weighting)."""
    return ops.assign_add(buf, grad * weight.astype(grad.dtype))


def scale_(factor: Tensor, buf: Tensor) -> Tensor:
    """Multiply the buffer by the window's factor (normalization and clipping together)."""
    return ops.assign(buf, buf * factor.astype(buf.dtype))


def square_sum(buf: Tensor) -> Tensor:
    """Sum of squares in float32, for the global L2 norm."""
    return ops.sum(ops.square(buf.astype(ms.float32)))
