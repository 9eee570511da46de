"""Gradient-sync control: when the gradients of a window are reduced across ranks.

One small protocol, one class per strategy (after Lightning Fabric's ``_BackwardSyncControl``):

* :class:`LocalSync`: one process, nothing to reduce.
* :class:`DDPSync`: ``DistributedDataParallel``. DDP decides in its *forward* whether the coming
  backward all-reduces, from ``require_backward_grad_sync``; the accumulator therefore sets the
  flag for the next micro-batch right after the previous backward, so off-boundary micro-batches
  skip the all-reduce and the one that completes the window syncs the whole sum.

The accumulator calls, in order: :meth:`GradSync.prepare` after every micro-batch (the flag for
the next forward), :meth:`GradSync.sync_partial` when a partial window is flushed (no backward
of it synchronized), and :meth:`GradSync.reduce_window` at every boundary (one collective that
averages the window's loss sum and item total over ranks, as DDP averages gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["DDPSync", "GradSync", "LocalSync", "make_sync"]


class GradSync(Protocol):
    """What the accumulator needs from a distributed strategy."""

    world_size: int

    def prepare(self, sync_next: bool) -> None:
        """Set whether the next micro-batch's backward reduces gradients across ranks."""

    def sync_partial(self, params: Sequence[torch.Tensor]) -> None:
        """Average the local gradients over ranks now (a flushed, never-synced window)."""

    def reduce_window(self, loss_sum: Any, items: Any) -> tuple[Any, Any]:
        """Return ``(loss_sum, items)`` averaged over ranks; ``None`` entries stay ``None``."""


class LocalSync:
    """A single process: every method is a no-op."""

    world_size = 1

    def prepare(self, sync_next: bool) -> None:
        """Nothing to prepare."""

    def sync_partial(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing to synchronize."""

    def reduce_window(self, loss_sum: Any, items: Any) -> tuple[Any, Any]:
        """Return the values unchanged."""
        return loss_sum, items


class DDPSync:
    """Sync control for a ``DistributedDataParallel`` module.

    Args:
        module: the DDP-wrapped model whose forward the user calls.
    """

    def __init__(self, module: DistributedDataParallel) -> None:
        self.module = module
        self.group = module.process_group
        self.world_size = dist.get_world_size(self.group)

    def prepare(self, sync_next: bool) -> None:
        """Set DDP's flag, read by its next forward (nanoGPT's ``require_backward_grad_sync``)."""
        self.module.require_backward_grad_sync = sync_next

    def sync_partial(self, params: Sequence[torch.Tensor]) -> None:
        """Average gradients over ranks in one flat all-reduce, as DDP's own sync would.

        A parameter without a gradient on this rank contributes zeros; it keeps ``grad=None``
        only when no rank has a gradient for it (DDP's ``find_unused_parameters`` semantics).
        """
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            return
        device = trainable[0].device
        has = torch.tensor([p.grad is not None for p in trainable], device=device, dtype=torch.int32)
        dist.all_reduce(has, group=self.group)
        used = [p for p, n in zip(trainable, has.tolist(), strict=True) if n > 0]
        for p in used:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in used if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)  # type: ignore[no-untyped-call]
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world_size)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads),  # type: ignore[no-untyped-call]
                            strict=True):
            g.copy_(synced)

    def reduce_window(self, loss_sum: Any, items: Any) -> tuple[Any, Any]:
        """Average the loss sum and the item total over ranks in a single all-reduce."""
        device = next(self.module.parameters()).device
        values = [loss_sum, items]
        present = [v for v in values if v is not None]
        if not present:
            return loss_sum, items
        vec = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(())
                           for v in present])
        dist.all_reduce(vec, group=self.group)
        vec.div_(self.world_size)
        out = iter(vec.unbind())
        return tuple(None if v is None else next(out) for v in values)  # type: ignore[return-value]


def make_sync(model: torch.nn.Module | None) -> GradSync:
    """Pick the sync control for ``model``.

    Returns:
        :class:`DDPSync` for a ``DistributedDataParallel`` module, else :class:`LocalSync`.

    Example:
        >>> make_sync(None).world_size
        1
    """
    if isinstance(model, DistributedDataParallel):
        return DDPSync(model)
    return LocalSync()
