"""Sync control for FSDP2 (``fully_shard``): one reduce-scatter per window, or one per micro-batch.

FSDP2 exposes the switch (``set_requires_gradient_sync``) but not the gradients it holds while
the switch is off; flushing and discarding a partial window reach them through its
internals, guarded so that a torch without them raises a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from gradaccum.torch.distributed.base import SyncMode
from gradaccum.torch.distributed.collectives import RankGroups

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["FSDPSync"]


class FSDPSync(RankGroups):
    """Sync control for an FSDP2 module (``torch.distributed.fsdp.fully_shard``).

    Args:
        module: the root ``fully_shard`` module (every FSDP submodule follows its flag).
        mode: ``"window"``: gradients stay unsharded and local until the window's last backward
            reduce-scatters them (least traffic; holds a full unsharded gradient per rank);
            ``"micro_batch"``: every backward reduce-scatters (only sharded gradients are held).
    """

    def __init__(self, module: FSDPModule, mode: SyncMode = "window") -> None:
        from torch.distributed.tensor import DTensor

        params = [p for p in module.parameters() if isinstance(p, DTensor)]  # type: ignore[attr-defined]
        if not params:
            raise ValueError("the FSDP2 module has no sharded (DTensor) parameters")
        mesh = params[0].device_mesh
        groups = [mesh.get_group(d) for d in range(mesh.ndim)]
        super().__init__(groups, params[0].device, mode)
        self.module = module
        self.watch_forward(module)  # type: ignore[arg-type]

    def prepare(self, sync_next: bool) -> bool:
        """Turn FSDP2's gradient reduction on for the window's last backward only."""
        armed = sync_next or self.mode == "micro_batch"
        self.module.set_requires_gradient_sync(armed)
        return armed

    def pause(self) -> None:
        """Turn FSDP2's gradient reduction off for the next backward (its gradients stay local)."""
        self.module.set_requires_gradient_sync(False)

    def sync_partial(self, params: Sequence[torch.Tensor], micro_steps: int) -> None:
        """Reduce-scatter the unsharded gradients a flushed window holds, as its last backward would.

        FSDP2 has no public call for this; it runs FSDP2's own end-of-backward callback with
        reduction on, which reduces every parameter group's pending gradients (its post-backward
        is safe to call outside a backward).

        Raises:
            RuntimeError: this torch's FSDP2 lacks that callback; use ``sync="micro_batch"`` or
                feed only full windows.
        """
        if self.mode == "micro_batch" or self.agree_on_length(micro_steps) is None:
            return
        state = self.module._get_fsdp_state()
        finish = getattr(state, "_root_post_backward_final_callback", None)
        if finish is None:
            raise RuntimeError(
                f"flush() of a partial FSDP2 window needs FSDP2's end-of-backward callback, which "
                f"torch {torch.__version__} does not have; pass sync='micro_batch' to the "
                "Accumulator, or feed only full windows"
            )
        self.module.set_requires_gradient_sync(True)
        finish()

    def discard(self) -> None:
        """Drop the unsharded gradients FSDP2 accumulated for a partial window.

        Without this, FSDP2 would add them into the next window's reduce-scatter.
        """
        super().discard()
        if self.mode == "micro_batch":
            return  # every backward reduced: only the sharded .grad, cleared by the accumulator
        self.drop_pending()

    def drop_pending(self) -> None:
        """Drop the unsharded gradients FSDP2 holds until its next reduction, whatever the mode.

        In ``"micro_batch"`` mode they are only those of a ``backward_cached`` call's chunks before
        its last (paused: the last reduces their sum): after such a call failed, they are its own.
        """
        for fsdp_param in self._fsdp_params():
            fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None

    def _fsdp_params(self) -> list[Any]:
        """FSDP2's per-parameter records (internals: no public API exposes pending gradients)."""
        try:
            states = self.module._get_fsdp_state()._state_ctx.all_states
            return [fp for state in states for group in state._fsdp_param_groups
                    for fp in group.fsdp_params]
        except AttributeError as e:
            raise RuntimeError(
                f"discard() under FSDP2 with sync='window' needs FSDP2 internals that torch "
                f"{torch.__version__} lacks ({e}); use sync='micro_batch'"
            ) from e

    def check_saveable(self) -> None:
        """Raise under ``"window"``: FSDP2 holds the partial window's unsharded gradients itself.

        Raises:
            RuntimeError: in ``"window"`` mode (the accumulator calls this mid-window only).
        """
        if self.mode == "window":
            raise RuntimeError(
                "state_dict() in the middle of a window under FSDP2 with sync='window': the "
                "partial gradients live unsharded inside FSDP2, out of any checkpoint's reach; "
                "save at a window boundary (acc.micro_step == 0) or use sync='micro_batch'"
            )
