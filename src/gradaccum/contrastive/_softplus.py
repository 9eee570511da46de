"""The tiled row sums of ``softplus(s * a @ b.T + t)``: SigLIP's pairs, every one a negative.

Forward: for each block of rows, ``u_i = sum_j softplus(s a_i . b_j + t)`` summed block by block
(``softplus(x) = -logsigmoid(-x)``, exact for every ``x``, without the threshold of
``torch.nn.functional.softplus``). Only ``u`` is kept; the backward pass recomputes each block and
turns ``g_u`` into ``dX_ij = g_u[i] sigmoid(x_ij)``, then ``dA = s dX @ b``, ``dB = s dX.T @ a``,
``ds = sum_ij dX_ij a_i . b_j`` and ``dt = sum_ij dX_ij``.

On several ranks each computes its rows (one SUM all-reduce of ``u``) and its rows' gradients
(one SUM all-reduce of the gradients of ``a``, ``b``, ``s`` and ``t``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.functional import logsigmoid

from gradaccum.contrastive._tiles import (
    Grads,
    Share,
    accumulate,
    logits,
    no_autocast,
    refuse_double_backward,
    spans,
    work_dtype,
)

__all__ = ["TiledSoftplusRows", "softplus_rows"]


class TiledSoftplusRows(torch.autograd.Function):
    """``u = softplus(s * a @ b.T + t).sum(1)``, tile by tile (in the work dtype)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                tile: int, share: Share) -> Any:
        work = work_dtype(a.dtype)
        with no_autocast(a.device):
            s, t = scale.detach().to(work), bias.detach().to(work)
            u = torch.zeros(len(a), dtype=work, device=a.device)
            for i0, i1 in spans(share.lo, share.hi, tile):
                ai, ui = a[i0:i1], u[i0:i1]
                for j0, j1 in spans(0, len(b), tile):
                    x = logits(ai, b[j0:j1], s, work).add_(t)
                    ui.sub_(logsigmoid(x.neg_()).sum(1))
            share.sum_(u)
        ctx.save_for_backward(a, b, scale, bias)
        ctx.tile, ctx.share, ctx.work = tile, share, work
        return u

    @staticmethod
    def backward(ctx: Any, g_u: torch.Tensor) -> Any:
        refuse_double_backward("siglip_loss")
        a, b, scale, bias = ctx.saved_tensors
        share, tile, work = ctx.share, ctx.tile, ctx.work
        with no_autocast(a.device):
            s, t = scale.detach().to(work), bias.detach().to(work)
            out = Grads(a, b, 2, work)
            for i0, i1 in spans(share.lo, share.hi, tile):
                ai = a[i0:i1]
                for j0, j1 in spans(0, len(b), tile):
                    bj = b[j0:j1]
                    d = logits(ai, bj, s, work).add_(t).sigmoid_().mul_(g_u[i0:i1, None])
                    out.scalars[1] += d.sum()
                    dx = d.to(a.dtype)
                    accumulate(out.a[i0:i1], dx, bj)
                    accumulate(out.b[j0:j1], dx.T, ai)
            own = slice(share.lo, share.hi)
            out.scalars[0] = torch.dot(a[own].reshape(-1).to(work), out.a[own].reshape(-1))
            share.sum_(out.flat)
            need = ctx.needs_input_grad
            da = out.a.mul_(s).to(a.dtype) if need[0] else None
            db = out.b.mul_(s).to(b.dtype) if need[1] else None
            ds = out.scalars[0].to(scale.dtype).reshape(scale.shape) if need[2] else None
            dt = out.scalars[1].to(bias.dtype).reshape(bias.shape) if need[3] else None
        return da, db, ds, dt, None, None


def softplus_rows(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, tile: int,
                  share: Share) -> torch.Tensor:
    """``softplus(scale * a @ b.T + bias).sum(1)``, tiled (:class:`TiledSoftplusRows`)."""
    u: torch.Tensor = TiledSoftplusRows.apply(a, b, scale, bias, tile, share)  # type: ignore[no-untyped-call]
    return u
