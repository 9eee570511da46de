"""The accumulator's entry in a Lightning checkpoint: one state, or every rank's under DDP.

Each DDP rank holds its own partial window (its own micro-batches' gradients), while Lightning
writes the checkpoint from rank 0 only: so the states are gathered into the checkpoint, and each
rank takes its own back on resume.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CHECKPOINT_KEY", "pack", "this_rank"]

CHECKPOINT_KEY = "gradaccum"
"""The key of the accumulator's state in a Lightning checkpoint (``checkpoint[CHECKPOINT_KEY]``)."""


def _world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def pack(state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint entry for this rank's ``state``: under DDP, every rank's, gathered (a
    collective: every rank saves at the same point, as Lightning requires).

    Example:
        >>> pack({"window": {"micro_step": 0}})
        {'window': {'micro_step': 0}}
    """
    _, world = _world()
    if world == 1:
        return state
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, _to_cpu(state))
    return {"ranks": ranks}


def this_rank(entry: Any) -> dict[str, Any] | None:
    """This rank's state from a checkpoint entry written by :func:`pack` (or None).

    Raises:
        ValueError: the entry holds another number of ranks' states, or one state with a partial
            window while several ranks resume (each needs its own partial gradients).
    """
    if entry is None:
        return None
    rank, world = _world()
    if "ranks" in entry:
        ranks = entry["ranks"]
        if len(ranks) != world:
            raise ValueError(f"the checkpoint holds the accumulator states of {len(ranks)} ranks; "
                             f"resume on as many, not {world}")
        return ranks[rank]  # type: ignore[no-any-return]
    if world > 1 and entry.get("window", {}).get("micro_step", 0):
        raise ValueError(f"the checkpoint holds one process's partial window; {world} ranks cannot "
                         "resume it (resume on one device, or from a checkpoint at a window boundary)")
    return entry  # type: ignore[no-any-return]

def _to_cpu(state: Any) -> Any:
    """``state`` with every tensor on the CPU (for ``all_gather_object``)."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_cpu(v) for v in state)
    return state
