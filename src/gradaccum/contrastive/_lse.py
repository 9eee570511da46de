"""The tiled log-sum-exp of ``s * a @ b.T`` over its rows and its columns, in one pass over the tiles.

Forward: for each block of rows, an online log-sum-exp over the blocks of columns gives each row's
``r_i = log sum_j exp(s a_i . b_j)``; the same blocks give each column's running
``c_j = log sum_i exp(s a_i . b_j)``. Only ``r`` and ``c`` (one number per row and per column) are
kept for the backward pass, which recomputes every block and turns the outputs' gradients
``g_r``, ``g_c`` into ``dS_ij = g_r[i] softmax_j(S)_ij + g_c[j] softmax_i(S)_ij``, then
``dA = s dS @ b``, ``dB = s dS.T @ a`` and ``ds = sum_ij dS_ij a_i . b_j``.

On several ranks (:class:`~gradaccum.contrastive._tiles.Share`), each computes its rows' ``r``
and its rows' part of every ``c``; the ranks take the columns' maximum (one MAX all-reduce) and sum
the rows and the shifted exponentials (one SUM all-reduce). In the backward pass each sums its
rows' gradients of ``a``, ``b`` and ``s`` into one buffer, and one SUM all-reduce gives every rank
the whole gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from gradaccum.contrastive._tiles import (
    Grads,
    Plan,
    Share,
    accumulate,
    logits,
    no_autocast,
    refuse_double_backward,
)

__all__ = ["TiledLogSumExp", "column_and_row_lse", "row_lse"]


def _combine(share: Share, r: torch.Tensor, c: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ranks' parts put together: ``r`` is summed (each rank's rows, zeros elsewhere) and the
    partial column log-sum-exps ``c`` are combined (shifted by their maximum over the ranks)."""
    if share.ranks is None:
        return r, c
    if c is None:
        share.sum_(r)
        return r, None
    top = c.clone()
    share.max_(top)
    both = torch.cat([r, c.sub_(top).exp_()])
    share.sum_(both)
    return both[:len(r)], top.add_(both[len(r):].log_())


class TiledLogSumExp(torch.autograd.Function):
    """``r = logsumexp(s * a @ b.T, dim=1)`` and, with ``columns``, ``c = logsumexp(..., dim=0)``,
    tile by tile (both in the plan's work dtype: float32 for 16-bit products)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, plan: Plan,
                columns: bool) -> Any:
        work, share = plan.work, plan.share
        with no_autocast(a.device):
            ag, bg, s = a.to(plan.gemm), b.to(plan.gemm), scale.detach().to(work)
            r = torch.zeros(len(a), dtype=work, device=a.device)
            r[share.lo:share.hi] = -torch.inf
            c = torch.full((len(b),), -torch.inf, dtype=work, device=a.device) if columns else None
            for i0, i1 in plan.rows():
                ai, ri = ag[i0:i1], r[i0:i1]
                for j0, j1 in plan.columns(len(b)):
                    block = logits(ai, bg[j0:j1], s, work)
                    torch.logaddexp(ri, block.logsumexp(1), out=ri)
                    if c is not None:
                        cj = c[j0:j1]
                        torch.logaddexp(cj, block.logsumexp(0), out=cj)
            r, c = _combine(share, r, c)
        ctx.save_for_backward(a, b, scale, r, c)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return (r, c) if columns else r

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        refuse_double_backward("clip_loss/info_nce")
        a, b, scale, r, c = ctx.saved_tensors
        g_r, g_c = grads[0], grads[1] if len(grads) > 1 else None
        plan: Plan = ctx.plan
        work = plan.work
        with no_autocast(a.device):
            ag, bg, s = a.to(plan.gemm), b.to(plan.gemm), scale.detach().to(work)
            out = Grads(a, b, 1, work)
            if g_r is not None or g_c is not None:
                for i0, i1 in plan.rows():
                    ai = ag[i0:i1]
                    for j0, j1 in plan.columns(len(b)):
                        bj = bg[j0:j1]
                        block = logits(ai, bj, s, work)
                        d = None
                        if g_r is not None:
                            d = (block - r[i0:i1, None]).exp_().mul_(g_r[i0:i1, None])
                        if g_c is not None:
                            q = block.sub_(c[None, j0:j1]).exp_().mul_(g_c[None, j0:j1])
                            d = q if d is None else d.add_(q)
                        assert d is not None
                        dx = d.to(plan.gemm)
                        accumulate(out.a[i0:i1], dx, bj)
                        accumulate(out.b[j0:j1], dx.T, ai)
                out.scale_dot(ag, plan.share)
            plan.share.sum_(out.flat)
            return (*out.results(a, b, (scale,), s, ctx.needs_input_grad), None, None)


def row_lse(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, plan: Plan) -> torch.Tensor:
    """``logsumexp(scale * a @ b.T, dim=1)``, tiled (:class:`TiledLogSumExp`)."""
    r: torch.Tensor = TiledLogSumExp.apply(a, b, scale, plan, False)  # type: ignore[no-untyped-call]
    return r


def column_and_row_lse(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, plan: Plan
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-sum-exps of ``scale * a @ b.T`` over each row and over each column, tiled."""
    both: tuple[torch.Tensor, torch.Tensor] = TiledLogSumExp.apply(  # type: ignore[no-untyped-call]
        a, b, scale, plan, True)
    return both
