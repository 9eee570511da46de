"""The balancing gradient, entered inside the user's backward: routes counted, and an identity on
each router's output whose backward adds the gradient of the micro-batch's share of the loss.

A micro-batch's share is ``sum_i a_i * S_i`` per layer (gradaccum.core.balance), with
``S_i = sum_t m_t p_{t,i}`` the masked sum of the router probabilities ``p = softmax(z)``. Its
gradient with respect to the logits is closed-form,
``d/dz_{t,k} = m_t p_{t,k} (a_k - sum_i a_i p_{t,i})``, so the identity's backward computes it from
the logits it kept (no second graph) and adds it, times the micro-batch's ``weight`` (what the
accumulator's normalization at the boundary will multiply it by, undone up front), to the
gradient flowing into the logits. The weights ``a`` and ``weight`` are known only when the
micro-batch's backward starts (the accumulator's feed hook fills the :class:`Slot`): the identity
reads them then. A reentrant checkpoint recomputes the router inside the backward, where the
identity is made again and reads the same slot; a non-reentrant one discards the recomputed
graph: either way the gradient enters once.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Site", "Slot", "count_routes", "inject", "probs64"]


class Slot:
    """One micro-batch's balancing weights, filled before its backward.

    Attributes:
        a: ``(layers, experts)`` float64 weights of the probability sums, or None before.
        weight: the factor the closed-form gradient is multiplied by (a number or a tensor).
    """

    def __init__(self) -> None:
        self.a: torch.Tensor | None = None
        self.weight: Any = None


class Site:
    """What a router's identity needs in its backward: the logits (detached), the micro-batch's
    row mask (float64, or None: every row), the layer and the slot."""

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor | None, layer: int, slot: Slot) -> None:
        self.logits = logits
        self.mask = mask
        self.layer = layer
        self.slot = slot


def probs64(logits: torch.Tensor) -> torch.Tensor:
    """Router probabilities in float64 (or the logits' dtype, if wider), rows by experts."""
    z = logits.detach().reshape(-1, logits.shape[-1])
    return torch.softmax(z if z.dtype == torch.float64 else z.to(torch.float64), dim=-1)


def count_routes(logits: torch.Tensor, mask: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """The masked top-k routes per expert of one router call, float64 ``(experts,)``."""
    p = probs64(logits)
    chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
    weights = (torch.ones(p.shape[0], dtype=p.dtype, device=p.device) if mask is None
               else mask.to(p.device)).repeat_interleave(top_k)
    return torch.zeros(p.shape[1], dtype=p.dtype, device=p.device).scatter_add_(0, chosen, weights)


def _gradient(site: Site) -> torch.Tensor:
    slot = site.slot
    if slot.a is None:
        raise RuntimeError(
            "a router of a LoadBalance model ran a backward that was not fed through the accumulator: "
            "call acc.backward(loss) (or acc.micro_batch()) inside balance.windows(), not "
            "loss.backward()")
    p = probs64(site.logits)
    a = slot.a[site.layer].to(p.device)
    g = p * (a - (p @ a).unsqueeze(-1))
    if site.mask is not None:
        g = g * site.mask.to(p.device).unsqueeze(-1)
    weight = slot.weight
    if isinstance(weight, torch.Tensor):
        weight = weight.to(p.device, torch.float64)
    out: torch.Tensor = (g * weight).reshape(site.logits.shape)
    return out


class _Identity(torch.autograd.Function):
    """Outputs its tensors unchanged; its backward adds the closed-form gradient to the logits'."""

    @staticmethod
    def forward(ctx: Any, site: Site, logits_at: int, *tensors: torch.Tensor) -> Any:
        ctx.site, ctx.logits_at = site, logits_at
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        out = list(grads)
        extra = _gradient(ctx.site)
        i = ctx.logits_at
        out[i] = extra.to(out[i].dtype) if out[i] is None else out[i] + extra.to(out[i].dtype)
        return (None, None, *out)


def inject(output: Any, logits: torch.Tensor, site: Site) -> Any:
    """``output`` with its gradient-carrying float tensors (the logits among them) passed through
    the identity; ``output`` unchanged when the logits need no gradient."""
    if not logits.requires_grad:
        return output
    if isinstance(output, torch.Tensor):
        return _Identity.apply(site, 0, output)[0]  # type: ignore[no-untyped-call]
    items = list(output)
    at = [i for i, t in enumerate(items) if isinstance(t, torch.Tensor) and t.is_floating_point()
          and t.requires_grad]
    logits_at = next(k for k, i in enumerate(at) if items[i] is logits)
    passed = _Identity.apply(site, logits_at, *(items[i] for i in at))  # type: ignore[no-untyped-call]
    for k, i in enumerate(at):
        items[i] = passed[k]
    return type(output)(items) if isinstance(output, tuple) else items
