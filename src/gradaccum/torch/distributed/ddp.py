"""Sync control for ``DistributedDataParallel``: one gradient all-reduce per window."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gradaccum.torch._grads import grads_used_anywhere
from gradaccum.torch.distributed.base import SyncMode
from gradaccum.torch.distributed.collectives import RankGroups

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["DDPSync", "arm_backward", "needs_hook_of"]


class DDPSync(RankGroups):
    """Sync control for a ``DistributedDataParallel`` module.

    Args:
        module: the DDP-wrapped model whose forward the user calls.
        mode: ``"window"`` (all-reduce once per window) or ``"micro_batch"`` (every backward).
    """

    def __init__(self, module: DistributedDataParallel, mode: SyncMode = "window") -> None:
        device = next(module.parameters()).device
        super().__init__([module.process_group], device, mode)
        self.module = module
        # True with float32 accumulation buffers: DDP never reduces (it would reduce one
        # micro-batch's low-precision .grad); the accumulator averages the wide sums itself.
        self.reduces_at_boundary = False
        self.watch_forward(module)

    def prepare(self, sync_next: bool) -> bool:
        """Set DDP's flag, read by its next forward (nanoGPT's ``require_backward_grad_sync``)."""
        armed = not self.reduces_at_boundary and (sync_next or self.mode == "micro_batch")
        self.module.require_backward_grad_sync = armed
        return armed

    def pause(self) -> None:
        """Clear DDP's flag: the next forward's backward only accumulates."""
        self.module.require_backward_grad_sync = False

    def sync_partial(self, params: Sequence[torch.Tensor], micro_steps: int) -> None:
        """Average the flushed window's gradients over ranks, as DDP's own sync would.

        A parameter without a gradient on this rank contributes zeros; it keeps ``grad=None``
        only when no rank has a gradient for it (DDP's ``find_unused_parameters`` semantics).
        Gradients are flattened per dtype: one all-reduce each, after one small agreement.
        """
        if self.mode == "micro_batch":
            return  # every backward already synchronized
        if self.reduces_at_boundary:
            self.agree_on_length(micro_steps)  # the boundary averages every gradient
            return
        trainable = [p for p in params if p.requires_grad]
        used = self.agree_on_length(micro_steps, [p.grad is not None for p in trainable])
        if used is None:
            return
        self.average_(grads_used_anywhere(trainable, used))


def arm_backward(module: DistributedDataParallel, outputs: Sequence[torch.Tensor]) -> None:
    """Arm DDP's reducer for the coming backward when the forward did not run through the wrapper.

    DDP arms its reducer at the end of its own forward (when ``require_backward_grad_sync`` is
    set); a forward through the wrapped module's parts (Lightning's ``training_step`` under DDP,
    where the wrapper's forward is the step itself) arms nothing, so ``backward_cached`` arms it
    here before the chunk that reduces, as Lightning's ``prepare_for_backward`` does.
    """
    if not (torch.is_grad_enabled() and module.require_backward_grad_sync):
        return
    module.require_forward_param_sync = True
    find = module.find_unused_parameters and not module.static_graph
    module.reducer._rebuild_buckets()
    module.reducer.prepare_for_backward(list(outputs) if find else [])


def needs_hook_of(module: DistributedDataParallel) -> bool:
    """True when DDP must see every gradient it reduces arrive in the armed backward.

    Without ``find_unused_parameters``, a parameter whose gradient came earlier (one used only in
    ``backward_cached``'s ``loss_fn``) would leave its bucket waiting; with it, DDP reduces the
    ``.grad`` such a parameter already holds (it marks unused parameters ready itself).
    """
    return not module.find_unused_parameters
