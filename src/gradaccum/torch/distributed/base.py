"""Gradient-sync control: when the gradients of a window are reduced across ranks.

One small protocol, one class per strategy (after Lightning Fabric's ``_BackwardSyncControl``):

* :class:`LocalSync`: one process, nothing to reduce.
* ``DDPSync`` (``gradaccum.torch.distributed.ddp``): ``DistributedDataParallel``. DDP decides in its
  *forward* whether the coming backward all-reduces, from ``require_backward_grad_sync``; the
  accumulator therefore sets the flag for the next micro-batch right after the previous
  backward, so off-boundary micro-batches skip the all-reduce and the one that completes the
  window syncs the whole sum.
* ``FSDPSync`` (``gradaccum.torch.distributed.fsdp``): an FSDP2 (``fully_shard``) module.
  ``set_requires_gradient_sync(False)`` off-boundary keeps the window's gradients unsharded and
  local until the last micro-batch reduce-scatters their sum.

Both distributed classes take a mode: ``"window"`` (one gradient sync per window, the default) or
``"micro_batch"`` (sync every backward, as without accumulation: FSDP2 then keeps only sharded
gradients between micro-batches, at N times the reduce-scatter traffic).

The accumulator calls, in order: :meth:`GradSync.prepare` when a window opens, is resized or
restored, and once more before the window's last micro-batch (``True``: that backward reduces),
and :meth:`GradSync.pause` before each chunk of ``backward_cached`` but the last;
:meth:`GradSync.agree_count` once, at the run's first item-weighted micro-batch (the ranks' first
provisional total); :meth:`GradSync.sync_partial` from ``flush()`` on every rank (a partial
window's gradients were never reduced); :meth:`GradSync.check_forward` and
:meth:`GradSync.reduce_window` at every boundary (one 16-byte collective that averages the
window's loss sum and item total over ranks, as the gradients are averaged, and sums the counts
and totals of the window's ``mb.term`` slots; a rank whose guard refused the window sends NaN).
Under several ranks a guard that refuses on one rank only does not raise there: the accumulator
hands it to :meth:`GradSync.defer`, the window runs on (its collectives too), and
:meth:`GradSync.raise_deferred` raises it on every rank at the boundary, before the optimizer steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch

__all__ = ["SYNC_MODES", "GradSync", "LocalSync", "SyncMode", "agree_on_count", "check_sync_mode"]

SyncMode = Literal["window", "micro_batch", "local"]
SYNC_MODES: tuple[SyncMode, ...] = ("window", "micro_batch", "local")


def check_sync_mode(sync: Any) -> SyncMode:
    """Return ``sync`` if it names a sync mode.

    Raises:
        ValueError: anything but ``"window"``, ``"micro_batch"`` or ``"local"``.

    Example:
        >>> check_sync_mode("window")
        'window'
    """
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be 'window', 'micro_batch' or 'local', got {sync!r}")
    return sync  # type: ignore[no-any-return]


class GradSync(Protocol):
    """What the accumulator needs from a distributed strategy."""

    world_size: int

    def prepare(self, sync_next: bool) -> bool:
        """Set whether the next micro-batch's backward reduces gradients across ranks; return
        whether it will (``sync_next``, or every backward in ``"micro_batch"`` mode)."""

    def pause(self) -> None:
        """No reduction in the next backward, whatever the mode (a chunk of ``backward_cached``
        before the micro-batch's last: its backward reduces the sum once)."""

    def sync_partial(self, params: Sequence[torch.Tensor], micro_steps: int) -> None:
        """Reduce a flushed window's gradients now; called on every rank, even with 0 micro-steps."""

    def reduce_window(self, loss_sum: Any, items: Any,
                      sums: Sequence[Any] = ()) -> tuple[Any, Any, list[Any]]:
        """Return ``(loss_sum, items)`` averaged over ranks (``None`` entries stay ``None``) and
        ``sums`` summed over ranks, in one collective."""

    def agree_count(self, count: Any) -> Any:
        """The largest ``count`` of any rank (a number or 0-dim tensor), with no host read."""

    def check_saveable(self) -> None:
        """Raise if a partial window's gradients are not in ``.grad`` (so no checkpoint holds them)."""

    def defer(self, message: str) -> None:
        """Keep a guard's refusal on this rank for the window's boundary (several ranks only)."""

    def raise_deferred(self) -> None:
        """After :meth:`reduce_window`: raise on every rank if any rank deferred a refusal."""

    def check_forward(self) -> None:
        """At a boundary: raise if no forward ran through the wrapped model in this window."""

    def discard(self) -> None:
        """Drop partial-window gradients held outside ``.grad`` (the accumulator clears ``.grad``)."""

    def average_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Average ``tensors`` over the ranks in place, each in its own dtype."""

    def max_over_ranks(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the ranks, in one all-reduce.

        Every rank must call it at the same point. A flag (0 or 1) becomes "any rank";
        ``-count`` gives the minimum of a count.
        """


class LocalSync:
    """A single process: every method is a no-op."""

    world_size = 1

    def prepare(self, sync_next: bool) -> bool:
        """Nothing to prepare: no backward reduces."""
        return False

    def pause(self) -> None:
        """Nothing to pause."""

    def sync_partial(self, params: Sequence[torch.Tensor], micro_steps: int) -> None:
        """Nothing to synchronize."""

    def reduce_window(self, loss_sum: Any, items: Any,
                      sums: Sequence[Any] = ()) -> tuple[Any, Any, list[Any]]:
        """Return the values unchanged."""
        return loss_sum, items, list(sums)

    def agree_count(self, count: Any) -> Any:
        """One rank: the count itself."""
        return count

    def check_saveable(self) -> None:
        """The partial gradients are in ``.grad``."""

    def defer(self, message: str) -> None:
        """Not used: one rank raises where the guard refuses."""
        raise RuntimeError(message)

    def raise_deferred(self) -> None:
        """Nothing deferred."""

    def check_forward(self) -> None:
        """Nothing wraps the model."""

    def discard(self) -> None:
        """Nothing is held outside ``.grad``."""

    def average_(self, tensors: Sequence[torch.Tensor]) -> None:
        """One rank: nothing to average."""

    def max_over_ranks(self, values: Sequence[int]) -> list[int]:
        """One rank: the values themselves."""
        return list(values)


class _MaxOverRanks(Protocol):
    def max_over_ranks(self, values: Sequence[int]) -> list[int]: ...


def agree_on_count(sync: _MaxOverRanks, count: int,
                   flags: Sequence[bool] = ()) -> tuple[list[bool], int, int]:
    """Where the ranks stand, in one MAX all-reduce of ``[flags..., count, -count]``.

    Every rank must call it at the same point (flush, AutoBatch's out-of-memory agreement).

    Returns:
        For each flag whether any rank set it, then the smallest and the largest ``count``.

    Example:
        >>> agree_on_count(LocalSync(), 3, [True, False])
        ([True, False], 3, 3)
    """
    *anyone, longest, minus_shortest = sync.max_over_ranks([*map(int, flags), count, -count])
    return [bool(v) for v in anyone], -minus_shortest, longest
