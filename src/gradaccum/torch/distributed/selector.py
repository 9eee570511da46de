"""Pick the gradient-sync strategy for a model: the one place that knows every strategy.

The strategies import their base (:mod:`gradaccum.torch.distributed.base`), never this module,
so there is no import circle (the Lightning Fabric shape: a protocol, one module per strategy, a
selector). :class:`PendingSync` is the selector's answer for a plain module under several ranks
while ``torch.distributed.pipelining`` is imported: it may be a pipeline stage's, which
``backward_pipeline`` finds out at its first call (``torch/pipeline/``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from gradaccum.torch.distributed.base import GradSync, LocalSync, SyncMode, check_sync_mode
from gradaccum.torch.distributed.ddp import DDPSync
from gradaccum.torch.distributed.fsdp import FSDPSync

__all__ = ["PendingSync", "make_sync"]


class PendingSync(LocalSync):
    """A plain module under a process group of several ranks while pipelining is imported.

    Until the first micro-batch it is a single process's sync; ``backward_pipeline`` replaces it
    with a ``PipelineSync`` (``torch/pipeline/sync.py``), and any other feed raises the refusal
    ``make_sync`` would have raised at construction.

    Args:
        refusal: the message of that refusal.
        mode: the accumulator's ``sync``, for the pipeline's data-parallel reduction.
    """

    def __init__(self, refusal: str, mode: SyncMode = "window") -> None:
        self.refusal = refusal
        self.mode = mode

    def refuse_feed(self) -> None:
        """Raise the refusal: a plain module's micro-batch under a process group of several ranks.

        Raises:
            ValueError: always.
        """
        raise ValueError(self.refusal + "; a pipeline stage's module feeds its window through "
                         "acc.backward_pipeline(schedule, ...) (docs/PIPELINE.md)")


def make_sync(model: torch.nn.Module | None, mode: Any = "window") -> GradSync:
    """Pick the sync control for ``model``.

    Args:
        model: the model the user calls (``None``: a single process).
        mode: ``"window"`` or ``"micro_batch"`` (the Accumulator's ``sync``).

    Returns:
        ``DDPSync`` for a ``DistributedDataParallel`` module, ``FSDPSync`` for an FSDP2
        root module, else :class:`LocalSync`.

    Raises:
        ValueError: an unknown mode; a model with ``fully_shard`` submodules whose root is not
            sharded (no single flag would cover them); or, under a process group of more than one
            rank, a model that is neither DDP nor FSDP2 (``None`` included) without
            ``sync="local"``: each rank would normalize by its own item total and drift apart.
            While ``torch.distributed.pipelining`` is imported, such a model may be a pipeline
            stage's: a :class:`PendingSync` then defers the
            refusal to its first micro-batch, unless that comes through ``backward_pipeline``;
            so does an ``nn.ModuleList`` of FSDP2 roots (one rank's stages, which torch cannot
            shard as one), refused elsewhere.

    Example:
        >>> make_sync(None).world_size
        1
    """
    mode = check_sync_mode(mode)
    if mode == "local" or not dist.is_available() or not dist.is_initialized():
        return LocalSync()  # a DDP or FSDP2 module needs an initialized process group
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return DDPSync(model, mode)
    if isinstance(model, FSDPModule):
        return FSDPSync(model, mode)
    if _stage_list(model, FSDPModule):
        # A pipeline's FSDP2 stages, several per rank (docs/PIPELINE.md): torch cannot shard the
        # container itself; backward_pipeline takes each stage's FSDP2 module from the schedule.
        refusal = (f"model={type(model).__name__} of fully_shard modules: a container of FSDP2 roots is "
                   "the stages of a pipeline (fed by backward_pipeline); otherwise pass the FSDP2 root "
                   "module you call as model=")
        if "torch.distributed.pipelining" in sys.modules and dist.get_world_size() > 1:
            return PendingSync(refusal, mode)
        raise ValueError(refusal)
    if model is not None and any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError(
            f"model ({type(model).__name__}) has fully_shard submodules but is not itself an "
            "FSDPModule: call fully_shard(model) on the root too, then pass it as model="
        )
    if dist.get_world_size() > 1:
        # Each rank would normalize by its own item total, and the ranks drift apart silently.
        refusal = (
            f"model={'None' if model is None else type(model).__name__} while a process group of "
            f"{dist.get_world_size()} ranks is initialized: pass the DistributedDataParallel model "
            "(or the FSDP2 root) as model=, so gradients and item totals are averaged over every "
            "rank once per window; for ranks that train independently on purpose, pass sync='local'")
        if "torch.distributed.pipelining" in sys.modules:
            return PendingSync(refusal, mode)  # a pipeline stage's module: decided at its first micro-batch
        raise ValueError(refusal)
    return LocalSync()


def _stage_list(model: torch.nn.Module | None, root: type) -> bool:
    """``model`` is an ``nn.ModuleList`` (or ``ModuleDict``) whose every entry is a ``root``
    module: one rank's pipeline stages, each sharded on its own."""
    if not isinstance(model, (torch.nn.ModuleList, torch.nn.ModuleDict)):
        return False
    children = list(model.children())
    return bool(children) and all(isinstance(c, root) for c in children)
