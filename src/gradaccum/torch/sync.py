"""Gradient-sync control: when the gradients of a window are reduced across ranks.

One small protocol, one class per strategy (after Lightning Fabric's ``_BackwardSyncControl``):

* :class:`LocalSync`: one process, nothing to reduce.
* ``DDPSync`` (``gradaccum.torch.ddp``): ``DistributedDataParallel``. DDP decides in its
  *forward* whether the coming backward all-reduces, from ``require_backward_grad_sync``; the
  accumulator therefore sets the flag for the next micro-batch right after the previous
  backward, so off-boundary micro-batches skip the all-reduce and the one that completes the
  window syncs the whole sum.
* ``FSDPSync`` (``gradaccum.torch.fsdp``): an FSDP2 (``fully_shard``) module.
  ``set_requires_gradient_sync(False)`` off-boundary keeps the window's gradients unsharded and
  local until the last micro-batch reduce-scatters their sum.

Both distributed classes take a mode: ``"window"`` (one gradient sync per window, the default) or
``"micro_batch"`` (sync every backward, as without accumulation: FSDP2 then keeps only sharded
gradients between micro-batches, at N times the reduce-scatter traffic).

The accumulator calls, in order: :meth:`GradSync.prepare` after every micro-batch (the flag for
the next backward), :meth:`GradSync.sync_partial` from ``flush()`` on every rank (a partial
window's gradients were never reduced), and :meth:`GradSync.reduce_window` at every boundary
(one collective that averages the window's loss sum and item total over ranks, as the
gradients are averaged).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

__all__ = ["SYNC_MODES", "GradSync", "LocalSync", "SyncMode", "check_sync_mode", "make_sync"]

SyncMode = Literal["window", "micro_batch"]
SYNC_MODES: tuple[SyncMode, ...] = ("window", "micro_batch")


def check_sync_mode(sync: Any) -> SyncMode:
    """Return ``sync`` if it names a sync mode.

    Raises:
        ValueError: anything but ``"window"`` or ``"micro_batch"``.

    Example:
        >>> check_sync_mode("window")
        'window'
    """
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be 'window' or 'micro_batch', got {sync!r}")
    return sync  # type: ignore[no-any-return]


class GradSync(Protocol):
    """What the accumulator needs from a distributed strategy."""

    world_size: int

    def prepare(self, sync_next: bool) -> None:
        """Set whether the next micro-batch's backward reduces gradients across ranks."""

    def sync_partial(self, params: Sequence[torch.Tensor], micro_steps: int) -> None:
        """Reduce a flushed window's gradients now; called on every rank, even with 0 micro-steps."""

    def reduce_window(self, loss_sum: Any, items: Any) -> tuple[Any, Any]:
        """Return ``(loss_sum, items)`` averaged over ranks; ``None`` entries stay ``None``."""

    def check_saveable(self) -> None:
        """Raise if a partial window's gradients are not in ``.grad`` (so no checkpoint holds them)."""

    def discard(self) -> None:
        """Drop partial-window gradients held outside ``.grad`` (the accumulator clears ``.grad``)."""

    def max_over_ranks(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the ranks, in one all-reduce.

        Every rank must call it at the same point. A flag (0 or 1) becomes "any rank";
        ``-count`` gives the minimum of a count.
        """


class LocalSync:
    """A single process: every method is a no-op."""

    world_size = 1

    def prepare(self, sync_next: bool) -> None:
        """Nothing to prepare."""

    def sync_partial(self, params: Sequence[torch.Tensor], micro_steps: int) -> None:
        """Nothing to synchronize."""

    def reduce_window(self, loss_sum: Any, items: Any) -> tuple[Any, Any]:
        """Return the values unchanged."""
        return loss_sum, items

    def check_saveable(self) -> None:
        """The partial gradients are in ``.grad``."""

    def discard(self) -> None:
        """Nothing is held outside ``.grad``."""

    def max_over_ranks(self, values: Sequence[int]) -> list[int]:
        """One rank: the values themselves."""
        return list(values)


def make_sync(model: torch.nn.Module | None, mode: Any = "window") -> GradSync:
    """Pick the sync control for ``model``.

    Args:
        model: the model the user calls (``None``: a single process).
        mode: ``"window"`` or ``"micro_batch"`` (the Accumulator's ``sync``).

    Returns:
        ``DDPSync`` for a ``DistributedDataParallel`` module, ``FSDPSync`` for an FSDP2
        root module, else :class:`LocalSync`.

    Raises:
        ValueError: an unknown mode, or a model with ``fully_shard`` submodules whose root is
            not sharded (no single flag would cover them).

    Example:
        >>> make_sync(None).world_size
        1
    """
    mode = check_sync_mode(mode)
    if model is None or not dist.is_available() or not dist.is_initialized():
        return LocalSync()  # a DDP or FSDP2 module needs an initialized process group
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from gradaccum.torch.ddp import DDPSync
    from gradaccum.torch.fsdp import FSDPSync

    if isinstance(model, DistributedDataParallel):
        return DDPSync(model, mode)
    if isinstance(model, FSDPModule):
        return FSDPSync(model, mode)
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError(
            f"model ({type(model).__name__}) has fully_shard submodules but is not itself an "
            "FSDPModule: call fully_shard(model) on the root too, then pass it as model="
        )
    return LocalSync()
