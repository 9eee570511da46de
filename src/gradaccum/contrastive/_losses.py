"""CLIP's, InfoNCE's and SigLIP's losses, tiled: exact, with no ``B x B`` matrix in either pass.

Each loss is a tiled kernel over the off-diagonal structure (the log-sum-exps of CLIP and InfoNCE,
SigLIP's sum of softplus over every pair) plus its positives' term, ``s * a_i . b_i`` for each
row, computed directly (``O(B d)``). The vectors are taken as given: normalize them first for
cosine similarities.
"""

from __future__ import annotations

from typing import Any

import torch

from gradaccum.contrastive._checks import check_pair, check_scalar, check_tile
from gradaccum.contrastive._lse import column_and_row_lse, row_lse
from gradaccum.contrastive._softplus import softplus_rows
from gradaccum.contrastive._tiles import Plan, Share, gemm_dtype, work_dtype

__all__ = ["clip_loss", "info_nce", "siglip_loss"]


def _plan(a: torch.Tensor, tile: Any) -> Plan:
    """How the kernel walks ``a``'s rows: the checked tile, this process's share, the products' dtype."""
    return Plan(check_tile(tile, a.device), Share.of(len(a)), gemm_dtype(a))


def _positives(a: torch.Tensor, b: torch.Tensor, plan: Plan) -> torch.Tensor:
    """``a_i . b_i`` for each row ``i`` of ``a``: the operands rounded to the plan's product
    dtype, as in the blocks, and summed in its work dtype."""
    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(plan.gemm).to(work_dtype(plan.gemm))

    return (rounded(a) * rounded(b[:len(a)])).sum(1)


def clip_loss(a: torch.Tensor, b: torch.Tensor, logit_scale: Any, *, tile: int | None = None) -> torch.Tensor:
    """CLIP's symmetric contrastive loss, tiled.

    ``(CE(s * a @ b.T, diag) + CE(s * b @ a.T, diag)) / 2``, each cross-entropy a mean over the
    rows, ``s = logit_scale``: row ``i`` of ``a`` (an image) and row ``i`` of ``b`` (its text) are
    each other's positive, every other row of the batch a negative. ``s`` is the multiplier itself
    (OpenCLIP passes ``logit_scale.exp()``). Both directions come from the same blocks of
    ``a @ b.T``; the backward pass recomputes them. Memory: ``O((B + tile) * d + tile^2)``.

    Under ``Accumulator.backward_cached`` on several ranks (DDP, FSDP2) each rank computes only its
    share of the rows against every column, and the ranks sum their parts (docs/CONTRASTIVE.md).

    Args:
        a: ``(B, d)`` features, one row per pair (taken as given: normalize them for cosines).
        b: ``(B, d)`` features of the other modality, same dtype and device.
        logit_scale: the logits' multiplier: a float or a one-element tensor (learnable: it gets
            its gradient).
        tile: rows and columns of one block (None: 1,024 on the CPU, 8,192 on a GPU).

    Returns:
        The loss, a 0-dim tensor (float32 for 16-bit features, else their dtype).

    Raises:
        TypeError, ValueError: ``tile`` not a positive integer; ``a`` or ``b`` not 2-D floating
            tensors of one width, dtype, device and number of rows; ``logit_scale`` not a finite
            scalar on their device.

    Example:
        >>> import torch
        >>> from gradaccum.contrastive import clip_loss
        >>> a, b = torch.randn(6, 4), torch.randn(6, 4)
        >>> logits = 2.0 * a @ b.T
        >>> dense = (torch.nn.functional.cross_entropy(logits, torch.arange(6))
        ...          + torch.nn.functional.cross_entropy(logits.T, torch.arange(6))) / 2
        >>> torch.allclose(clip_loss(a, b, 2.0, tile=4), dense)
        True
    """
    a, b = check_pair(("a", "b"), a, b, same_rows=True)
    s = check_scalar("logit_scale", logit_scale, a)
    plan = _plan(a, tile)
    r, c = column_and_row_lse(a, b, s, plan)
    return (r.mean() + c.mean()) / 2 - s.to(r.dtype) * _positives(a, b, plan).mean()


def info_nce(queries: torch.Tensor, keys: torch.Tensor, scale: Any, *,
             tile: int | None = None) -> torch.Tensor:
    """InfoNCE with in-batch negatives, tiled: ``CE(scale * queries @ keys.T, arange(len(queries)))``.

    Row ``i`` of ``keys`` is the positive of query ``i``; every other key is a negative, the keys
    after the first ``len(queries)`` (hard negatives, as sentence-transformers'
    ``MultipleNegativesRankingLoss`` appends them) included. Memory: ``O((B + tile) * d + tile^2)``;
    under ``backward_cached`` on several ranks, each computes its share of the queries.

    Args:
        queries: ``(B, d)`` features (taken as given: normalize them for cosines).
        keys: ``(K, d)`` features, ``K >= B``, same dtype and device.
        scale: the logits' multiplier (``1 / temperature``): a float or a one-element tensor.
        tile: rows and columns of one block (None: 1,024 on the CPU, 8,192 on a GPU).

    Returns:
        The mean over the queries, a 0-dim tensor (float32 for 16-bit features).

    Raises:
        TypeError, ValueError: as :func:`clip_loss`, and ``keys`` with fewer rows than ``queries``.

    Example:
        >>> import torch
        >>> from gradaccum.contrastive import info_nce
        >>> q, k = torch.randn(4, 8), torch.randn(6, 8)  # two hard negatives after the positives
        >>> dense = torch.nn.functional.cross_entropy(20.0 * q @ k.T, torch.arange(4))
        >>> torch.allclose(info_nce(q, k, 20.0, tile=3), dense)
        True
    """
    queries, keys = check_pair(("queries", "keys"), queries, keys, same_rows=False)
    s = check_scalar("scale", scale, queries)
    plan = _plan(queries, tile)
    r = row_lse(queries, keys, s, plan)
    return r.mean() - s.to(r.dtype) * _positives(queries, keys, plan).mean()


def siglip_loss(a: torch.Tensor, b: torch.Tensor, logit_scale: Any, logit_bias: Any, *,
                tile: int | None = None) -> torch.Tensor:
    """SigLIP's pairwise sigmoid loss, tiled, as OpenCLIP's ``SigLipLoss`` on one process.

    ``-sum_ij logsigmoid(z_ij * (s * a_i . b_j + bias)) / B`` with ``z_ij = 1`` for ``i == j`` and
    ``-1`` otherwise, ``s = logit_scale`` (the multiplier itself: OpenCLIP passes
    ``logit_scale.exp()``). Memory: ``O((B + tile) * d + tile^2)``; under ``backward_cached`` on
    several ranks, each computes its share of the rows.

    Args:
        a: ``(B, d)`` features, one row per pair (taken as given).
        b: ``(B, d)`` features of the other modality, row ``i`` the pair of ``a``'s row ``i``.
        logit_scale: the multiplier, a float or a one-element tensor (learnable).
        logit_bias: the bias, a float or a one-element tensor (learnable).
        tile: rows and columns of one block (None: 1,024 on the CPU, 8,192 on a GPU).

    Returns:
        The loss, a 0-dim tensor (float32 for 16-bit features).

    Raises:
        TypeError, ValueError: as :func:`clip_loss`, for ``logit_bias`` too.

    Example:
        >>> import torch
        >>> from gradaccum.contrastive import siglip_loss
        >>> a, b = torch.randn(5, 4), torch.randn(5, 4)
        >>> z = 2 * torch.eye(5) - 1
        >>> dense = -torch.nn.functional.logsigmoid(z * (10.0 * a @ b.T - 10.0)).sum() / 5
        >>> torch.allclose(siglip_loss(a, b, 10.0, -10.0, tile=2), dense)
        True
    """
    a, b = check_pair(("a", "b"), a, b, same_rows=True)
    s = check_scalar("logit_scale", logit_scale, a)
    t = check_scalar("logit_bias", logit_bias, a)
    plan = _plan(a, tile)
    u = softplus_rows(a, b, s, t, plan)
    positives = s.to(u.dtype) * _positives(a, b, plan) + t.to(u.dtype)
    return (u.sum() - positives.sum()) / len(a)
