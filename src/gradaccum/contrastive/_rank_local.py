"""Rank-local rows for a loss of your own: each rank computes its share of a row-separable loss.

Under ``Accumulator.backward_cached`` on several ranks, every rank runs ``loss_fn`` on the same
gathered representations. A loss that is a sum over rows (each row scored against every column)
need not be computed whole on every rank: :func:`rank_local` hands each rank an even share of the
rows, sums the ranks' parts (one all-reduce of the scalar), and in the backward pass sums the
ranks' gradients of the tensors it was given (one all-reduce), so every rank ends with the whole
gradient, as if it had computed every row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradaccum.contrastive._tiles import Share

__all__ = ["rank_local"]


class _GradsSummed(torch.autograd.Function):
    """The tensors as they are; in the backward pass, their gradients summed over the ranks."""

    @staticmethod
    def forward(ctx: Any, share: Share, *tensors: torch.Tensor) -> Any:
        ctx.share = share
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        flat = torch.cat([g.reshape(-1) for g in grads])
        ctx.share.sum_(flat)
        parts = torch.split(flat, [g.numel() for g in grads])
        return (None, *(p.view_as(g) for p, g in zip(parts, grads, strict=True)))


class _Summed(torch.autograd.Function):
    """The sum of every rank's ``part``; each rank's part gets the sum's gradient."""

    @staticmethod
    def forward(ctx: Any, share: Share, part: torch.Tensor) -> torch.Tensor:
        total = part.detach().clone()
        share.sum_(total)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return None, grad


def _check(loss_rows: Any, rows: Any) -> None:
    if not callable(loss_rows):
        raise TypeError(f"loss_rows must be callable (part, *tensors) -> the rows' summed loss, got a "
                        f"{type(loss_rows).__name__}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
        raise ValueError(f"rows must be a positive int (how many rows the loss sums over), got {rows!r}")


def rank_local(loss_rows: Callable[..., torch.Tensor], rows: int, *tensors: torch.Tensor) -> torch.Tensor:
    """The sum of a row-separable loss over ``rows`` rows, each rank computing only its share.

    ``loss_rows(part, *tensors)`` returns the sum of the loss's terms of the rows in ``part`` (a
    ``slice`` of ``range(rows)``). On one process, and outside ``backward_cached``'s ``loss_fn``,
    this is ``loss_rows(slice(0, rows), *tensors)``. While ``backward_cached`` runs ``loss_fn`` on
    several ranks, rank ``r`` of ``W`` computes the rows ``rows * r // W`` to
    ``rows * (r + 1) // W``; the ranks' parts are summed (the same value on every rank) and, in the
    backward pass, so are the gradients of ``tensors`` (two all-reduces per call), so every rank
    gets the gradient of the whole sum, exactly as if it had computed every row.

    The rule: every tensor ``loss_rows`` uses that needs a gradient (the representations, a
    learnable temperature) must come in through ``tensors``; a tensor it reads from elsewhere
    gets only this rank's rows' part of its gradient.

    Args:
        loss_rows: ``(part, *tensors) -> 0-dim tensor``, the rows' summed loss.
        rows: how many rows the loss sums over.
        tensors: the tensors ``loss_rows`` computes from (given back to it in the same order).

    Returns:
        The sum over every row, a 0-dim tensor (divide by ``rows`` for a mean).

    Raises:
        TypeError, ValueError: ``loss_rows`` not callable; ``rows`` not a positive int;
            ``loss_rows`` returned anything but a one-element tensor.

    Example:
        >>> import torch
        >>> from gradaccum.contrastive import rank_local
        >>> z = torch.randn(6, 4, requires_grad=True)
        >>> def rows_lse(part, z):  # each row's log-sum-exp over every column
        ...     return (z[part] @ z.T).logsumexp(1).sum()
        >>> loss = rank_local(rows_lse, len(z), z) / len(z)
        >>> torch.allclose(loss, (z @ z.T).logsumexp(1).mean())
        True
    """
    _check(loss_rows, rows)
    share = Share.of(rows)
    if share.ranks is None:
        return _scalar(loss_rows(slice(0, rows), *tensors))
    learnable = [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
    given = list(tensors)
    if learnable:
        summed = _GradsSummed.apply(share, *(tensors[i] for i in learnable))  # type: ignore[no-untyped-call]
        for i, t in zip(learnable, summed, strict=True):
            given[i] = t
    part = _scalar(loss_rows(slice(share.lo, share.hi), *given))
    total: torch.Tensor = _Summed.apply(share, part.reshape(()))  # type: ignore[no-untyped-call]
    return total


def _scalar(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
            f"a {type(value).__name__}"
        raise ValueError(f"loss_rows must return the rows' summed loss, a one-element tensor; it returned "
                         f"{what}")
    return value
