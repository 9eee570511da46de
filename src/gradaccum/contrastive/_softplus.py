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

from gradaccum.contrastive._tiles import Grads, Plan, accumulate, logits, no_autocast, refuse_double_backward

__all__ = ["TiledSoftplusRows", "softplus_rows"]


class TiledSoftplusRows(torch.autograd.Function):
    """``u = softplus(s * a @ b.T + t).sum(1)``, tile by tile (in the plan's work dtype)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                plan: Plan) -> Any:
        work = plan.work
        with no_autocast(a.device):
            ag, bg = a.to(plan.gemm), b.to(plan.gemm)
            s, t = scale.detach().to(work), bias.detach().to(work)
            u = torch.zeros(len(a), dtype=work, device=a.device)
            for i0, i1 in plan.rows():
                ai, ui = ag[i0:i1], u[i0:i1]
                for j0, j1 in plan.columns(len(b)):
                    x = logits(ai, bg[j0:j1], s, work).add_(t)
                    ui.sub_(logsigmoid(x.neg_()).sum(1))
            plan.share.sum_(u)
        ctx.save_for_backward(a, b, scale, bias)
        ctx.plan = plan
        return u

    @staticmethod
    def backward(ctx: Any, g_u: torch.Tensor) -> Any:
        refuse_double_backward("siglip_loss")
        a, b, scale, bias = ctx.saved_tensors
        plan: Plan = ctx.plan
        work = plan.work
        with no_autocast(a.device):
            ag, bg = a.to(plan.gemm), b.to(plan.gemm)
            s, t = scale.detach().to(work), bias.detach().to(work)
            out = Grads(a, b, 2, work)
            for i0, i1 in plan.rows():
                ai = ag[i0:i1]
                for j0, j1 in plan.columns(len(b)):
                    bj = bg[j0:j1]
                    d = logits(ai, bj, s, work).add_(t).sigmoid_().mul_(g_u[i0:i1, None])
                    out.scalars[1] += d.sum()
                    dx = d.to(plan.gemm)
                    accumulate(out.a[i0:i1], dx, bj)
                    accumulate(out.b[j0:j1], dx.T, ai)
            out.scale_dot(ag, plan.share)
            plan.share.sum_(out.flat)
            return (*out.results(a, b, (scale, bias), s, ctx.needs_input_grad), None)


def softplus_rows(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                  plan: Plan) -> torch.Tensor:
    """``softplus(scale * a @ b.T + bias).sum(1)``, tiled (:class:`TiledSoftplusRows`)."""
    u: torch.Tensor = TiledSoftplusRows.apply(a, b, scale, bias, plan)  # type: ignore[no-untyped-call]
    return u
