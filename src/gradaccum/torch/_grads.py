"""In-place passes over gradients: collect, scale, clip. Each is at most one foreach pass."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.utils import get_total_norm

from gradaccum.core.window import is_one

__all__ = ["grads_of", "grads_used_anywhere", "graph_nodes", "group_by_device", "scale_and_clip_",
           "scale_grads_", "version"]


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The ``.grad`` of every parameter that has one, in parameter order."""
    return [p.grad for p in params if p.grad is not None]


def grads_used_anywhere(params: Iterable[torch.Tensor], anyone: Iterable[bool]) -> list[torch.Tensor]:
    """The ``.grad`` of every parameter some rank used (``anyone``), a zero gradient where this
    rank has none: what it contributes to an average over ranks, as DDP does."""
    grads = []
    for p, used in zip(params, anyone, strict=False):
        if used:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    return grads


def group_by_device(tensors: Iterable[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    """The tensors grouped by device, in order: one foreach call per device.

    Example:
        >>> list(group_by_device([torch.ones(1), torch.zeros(2)]))
        [device(type='cpu')]
    """
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups


def scale_grads_(grads: Sequence[torch.Tensor], factor: Any) -> None:
    """Multiply every gradient by ``factor`` (a number or a 0-dim tensor) in one foreach pass.

    A factor of exactly 1 costs nothing: full windows under mean weighting never pay a pass.

    Example:
        >>> g = [torch.ones(2)]
        >>> scale_grads_(g, 0.5)
        >>> g[0]
        tensor([0.5000, 0.5000])
    """
    if not grads or is_one(factor):
        return
    if not isinstance(factor, torch.Tensor):
        torch._foreach_mul_(list(grads), float(factor))
        return
    if all(g.device == factor.device for g in grads):
        torch._foreach_mul_(list(grads), factor)
        return
    for device, group in group_by_device(grads).items():
        torch._foreach_mul_(group, factor.to(device))


def scale_and_clip_(
    grads: Sequence[torch.Tensor], factor: Any, max_norm: float | None
) -> torch.Tensor | None:
    """Scale gradients by ``factor`` and clip their global L2 norm to ``max_norm``, in one pass.

    Equivalent to ``scale_grads_(grads, factor)`` followed by
    ``torch.nn.utils.clip_grad_norm_(grads, max_norm)``, but the two multiplications are fused:
    the norm of the scaled gradients is ``factor`` times the norm of the raw ones. FSDP2's
    sharded (DTensor) gradients are clipped by their global norm over every shard.

    Args:
        grads: the gradients, changed in place.
        factor: the normalization factor (a number or a 0-dim tensor).
        max_norm: the clipping threshold, or ``None`` for no clipping.

    Returns:
        The global L2 norm of the scaled gradients before clipping (a 0-dim tensor), or ``None``
        when ``max_norm`` is ``None``.

    Example:
        >>> g = [torch.tensor([3.0, 4.0])]
        >>> float(scale_and_clip_(g, 2.0, 1.0))
        10.0
        >>> round(float(g[0].norm()), 4)
        1.0
    """
    if max_norm is None:
        scale_grads_(grads, factor)
        return None
    if not grads:
        return torch.zeros(())
    norm = get_total_norm(grads, foreach=True)
    full_tensor = getattr(norm, "full_tensor", None)
    if full_tensor is not None:
        # FSDP2's DTensor gradients give a DTensor norm over every shard: read it as a plain
        # tensor, identical on every rank, so the coefficient below scales every shard alike.
        norm = full_tensor()
    if not is_one(factor):
        norm = norm * factor
    # Same coefficient as torch.nn.utils.clip_grad_norm_, so both clip identically.
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    scale_grads_(grads, coef if is_one(factor) else coef * factor)
    return norm


def version(t: torch.Tensor) -> int:
    """The in-place version counter of a tensor's values (an FSDP2 DTensor's: its local shard's)."""
    return int(getattr(t, "_local_tensor", t)._version)


def graph_nodes(roots: Iterable[Any]) -> Iterator[Any]:
    """Every node of the autograd graph reachable from ``roots`` (``grad_fn`` nodes; None is
    skipped), each once, depth first; a leaf's ``AccumulateGrad`` node holds it as ``variable``."""
    seen: set[Any] = set()
    todo = list(roots)
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        todo.extend(fn for fn, _ in node.next_functions)
