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

__all__ = ["Site", "Slot", "add_routes", "count_routes", "inject", "probs64"]


class Slot:
    """One micro-batch's balancing weights, filled before its backward.

    Attributes:
        a: ``(layers, experts)`` float64 weights of the probability sums, or None before.
        weight: the factor the closed-form gradient is multiplied by (a number or a tensor); set
            after :attr:`a`, it makes :attr:`aw`.
        aw: ``a * weight``, made once per backward (not once per router call), or None before.
    """

    def __init__(self) -> None:
        self.a: torch.Tensor | None = None
        self.aw: torch.Tensor | None = None
        self._weight: Any = None

    @property
    def weight(self) -> Any:
        return self._weight

    @weight.setter
    def weight(self, weight: Any) -> None:
        self._weight = weight
        if self.a is None or weight is None:
            self.aw = None
            return
        if isinstance(weight, torch.Tensor):
            weight = weight.to(self.a.device, torch.float64)
        self.aw = self.a * weight


class Site:
    """What a router's identity needs in its backward: the logits (detached, rows by experts),
    the micro-batch's row mask (float64, flattened ``(rows,)`` or a column ``(rows, 1)``; None:
    every row), the layer, the slot, and the shape of the logits' gradient (default: the logits')."""

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor | None, layer: int, slot: Any,
                 shape: torch.Size | None = None) -> None:
        self.logits = logits
        self.mask = mask
        self.layer = layer
        self.slot = slot
        self.shape = logits.shape if shape is None else shape


def probs64(logits: torch.Tensor) -> torch.Tensor:
    """Router probabilities in float64 (or the logits' dtype, if wider), rows by experts."""
    z = logits.detach().reshape(-1, logits.shape[-1])
    return torch.softmax(z if z.dtype == torch.float64 else z.to(torch.float64), dim=-1)


def count_routes(logits: torch.Tensor, mask: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """The masked top-k routes per expert of one router call, float64 ``(experts,)``."""
    rows = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.zeros(rows.shape[-1], dtype=torch.float64, device=rows.device)
    add_routes(rows, None if mask is None else mask.repeat_interleave(top_k), top_k, out)
    return out


def add_routes(rows: torch.Tensor, weights: torch.Tensor | None, top_k: int, into: torch.Tensor) -> None:
    """Add the masked top-k routes per expert of one router call to ``into`` (float64
    ``(experts,)``), in place: one top-k of the logits (the softmax keeps their order: no float64
    softmax) and one ``index_add_``.

    Args:
        rows: the router's logits, detached, rows by experts.
        weights: each route's weight, the row mask repeated ``top_k`` times (float64), or None
            (every route counts 1).
        top_k: routes per token.
        into: the layer's counts.
    """
    chosen = torch.topk(rows, top_k, dim=-1).indices.reshape(-1)
    if weights is None:
        weights = torch.ones(chosen.shape[0], dtype=into.dtype, device=into.device)
    into.index_add_(0, chosen, weights.to(into.device))


def _weights(slot: Any) -> torch.Tensor:
    """``a * weight`` of a slot: made once per backward when a :class:`Slot`'s weight is set, or here (a
    slot that holds ``a`` and ``weight`` alone)."""
    aw = getattr(slot, "aw", None)
    if aw is not None:
        return aw  # type: ignore[no-any-return]
    a = slot.a
    if a is None:
        raise RuntimeError(
            "a router of a LoadBalance model ran a backward that was not fed through the accumulator: "
            "call acc.backward(loss) (or acc.micro_batch()) inside balance.windows(), not "
            "loss.backward()")
    weight = slot.weight
    if isinstance(weight, torch.Tensor):
        weight = weight.to(a.device, torch.float64)
    return a * weight  # type: ignore[no-any-return]


def _gradient(site: Site) -> torch.Tensor:
    aw = _weights(site.slot)
    z = site.logits
    p = torch.softmax(z if z.dtype == torch.float64 else z.to(torch.float64), dim=-1)
    a = aw[site.layer].to(p.device)  # a * weight, this layer's
    g = p * (a - (p @ a).unsqueeze(-1))
    mask = site.mask
    if mask is not None:
        g = g * (mask if mask.dim() == 2 else mask.unsqueeze(-1)).to(p.device)
    return g.view(site.shape)


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
        dtype = ctx.site.logits.dtype if out[i] is None else out[i].dtype
        out[i] = extra.to(dtype) if out[i] is None else out[i] + extra.to(dtype)
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
