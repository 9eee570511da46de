"""Micro-batch weights as torch tensors: the backward seed, the provisional total, wide totals.

The core (:mod:`gradaccum.core.window`) says what each micro-batch weighs; this module makes those
weights cheap in torch. The weight is not multiplied into the loss (a multiplication in the
forward, another in the backward): it *is* the gradient that ``backward`` starts from,
``loss.backward(gradient=seed)``, which autograd would otherwise fill with ones. So the mean path
costs one small tensor per micro-step, and a tensor count one multiplication.

Precision of the seed ``n_i / P`` (``P`` a power of two for tensor counts): exact while ``n_i``
fits the loss's significand: below 2**24 in float32, 2**53 in float64, 2**11 in float16 and 2**8
in bfloat16 (beyond, it rounds once, as the loss itself does). Totals are summed in float64 on
devices that have it; where float64 is missing (Apple's MPS) integer counts are summed in int64
(exact) and float weights in float32, and the boundary's correction ``P / sum(n_i)`` is computed
in float32 (relative error 2**-24).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gradaccum.core.window import Window, provisional_total

if TYPE_CHECKING:
    from gradaccum.torch.distributed.base import GradSync

__all__ = ["NO_FLOAT64", "exact_total", "float_total", "loss_seed", "wide_count", "wide_dtype", "window_term"]

# Device types whose kernels have no float64.
NO_FLOAT64 = frozenset({"mps"})


def wide_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype an item total of ``dtype`` counts is summed in on ``device``.

    Example:
        >>> wide_dtype(torch.device("cpu"), torch.int64), wide_dtype(torch.device("mps"), torch.int32)
        (torch.float64, torch.int64)
    """
    if device.type not in NO_FLOAT64:
        return torch.float64
    return torch.float32 if dtype.is_floating_point else torch.int64


def wide_count(n: torch.Tensor) -> torch.Tensor:
    """A micro-batch's count as the first term of a window's total: a new tensor (the caller's
    may change later) in :func:`wide_dtype`. Later counts add to it in that dtype."""
    return n.to(wide_dtype(n.device, n.dtype), copy=True)


def float_total(total: Any) -> Any:
    """An item total ready to divide by: an integer tensor (the int64 route where float64 is
    missing) as float32, anything else as it is."""
    if isinstance(total, torch.Tensor) and not total.is_floating_point():
        return total.to(torch.float32)
    return total


def exact_total(count: Any, size: int) -> Any:
    """The provisional total of :func:`gradaccum.core.window.provisional_total` for a window of
    ``size``; a tensor ``count`` gives a power of two within ``(size * count, 2 * size * count]``
    (1 for a count of 0), so that every ``n_i / P`` is exact in the loss's format (module
    docstring). In the wide dtype (:func:`wide_dtype`): a window's total may be a Python number
    (its counts changed kind), and the boundary's ``P / total`` and each seed ``n_i / P`` are then
    computed in float64, rounded once into the loss's format as the Python path rounds them.

    Example:
        >>> exact_total(3, 4), exact_total(torch.tensor(3), 4)
        (12, tensor(16., dtype=torch.float64))
    """
    if not isinstance(count, torch.Tensor):
        return provisional_total(count, size)
    _, exponent = torch.frexp(count * float(size))  # count * size = m * 2**e, m in [0.5, 1)
    return torch.pow(2.0, exponent).to(wide_dtype(count.device, torch.float32))


def loss_seed(loss: torch.Tensor, n: Any, scale: Any, size: int, summed: bool) -> torch.Tensor | None:
    """The gradient a micro-batch's backward starts from: its weight in the window, as a new
    tensor of the loss's shape (a cached one, or the caller's count, could be taken over as a
    ``.grad`` and then changed in place); None for a weight of exactly 1 (autograd's own seed).

    Args:
        loss: the micro-batch's loss.
        n: its count (``None`` under mean weighting).
        scale: the window's provisional total ``P``, or None (the weight is ``n`` itself).
        size: the window's ``N``.
        summed: the loss is sum-reduced (weight ``1/P``, else ``n/P``).

    Example:
        >>> loss_seed(torch.tensor(2.0), None, None, 4, False)
        tensor(0.2500)
    """
    if n is None:
        return torch.full(loss.shape, 1.0 / size, dtype=loss.dtype, device=loss.device)
    if scale is None:
        if summed:
            return None
        if not isinstance(n, torch.Tensor):
            return torch.full(loss.shape, n, dtype=loss.dtype, device=loss.device)
        if n.device != loss.device:  # a CPU count of a GPU loss: one small copy
            seed = n.to(loss.device, loss.dtype, non_blocking=True)
        else:  # another dtype: autograd casts it into a new tensor (one kernel, no Python op)
            seed = n if n.dtype != loss.dtype else n.clone()
    elif not isinstance(scale, torch.Tensor):
        if not isinstance(n, torch.Tensor):
            return torch.full(loss.shape, (1 if summed else n) / scale, dtype=loss.dtype, device=loss.device)
        # A tensor count against a Python total (the window began with a Python count): the
        # weight in the wide dtype, rounded once to the loss's, as the Python path does.
        if summed:
            return torch.full(loss.shape, 1 / scale, dtype=loss.dtype, device=loss.device)
        wide = n.to(loss.device, wide_dtype(loss.device, n.dtype))
        seed = torch.div(wide, scale).to(loss.dtype)
    else:  # a wide P: the seed is computed wide, and autograd's engine casts it once
        seed = scale.reciprocal() if summed else n / scale
        if seed.device != loss.device:
            seed = seed.to(loss.device, non_blocking=True)
    return seed if seed.shape == loss.shape else seed.reshape(loss.shape)


def window_term(window: Window, n: Any, overflow_prone: bool, sync: GradSync) -> tuple[Any, Any]:
    """A micro-batch's count as a term of ``window``'s item total, and the window's provisional
    total ``P``: what :meth:`Window.advance` takes (``(None, None)`` under mean weighting).

    A window's first micro-batch starts the total (a tensor count as a wide copy) and fixes ``P``
    (core.window's rule; the ranks agree once, on the run's first, in one small collective). A
    later one keeps the window's ``P``; a tensor count joining a Python total (``len(batch)``
    then ``mask.sum()``) is added as a wide copy, as a first tensor count is: the total must not
    take the count's integer dtype (rounded to float32 when divided by) or its narrow float dtype.

    Args:
        window: the window before this micro-batch.
        n: the micro-batch's checked count, or None.
        overflow_prone: the gradients can overflow (a GradScaler, float16 parameters).
        sync: the accumulator's gradient sync (its world size, and the ranks' agreement).
    """
    if window.micro_step:
        if isinstance(n, torch.Tensor) and not isinstance(window.items, torch.Tensor):
            return wide_count(n), window.scale
        return n, window.scale
    if n is None:
        return None, None
    tensor = isinstance(n, torch.Tensor)
    term = wide_count(n) if tensor else n
    # A provisional total where it is needed (gradients that can overflow) or free (Python
    # counts on one process: host arithmetic, and no pass for a window of equal counts).
    if not (overflow_prone or (not tensor and sync.world_size == 1)):
        return term, None
    count = window.first_count(n)
    if window.basis is None and sync.world_size > 1:
        count = sync.agree_count(count)
    return term, exact_total(count, window.size)
