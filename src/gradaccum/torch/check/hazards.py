"""Name the modules that make N micro-batches differ from the full batch, and say what to do.

A module breaks the equivalence of accumulation when its forward on the full batch is not the
concatenation of its forwards on the micro-batches (it mixes the samples of a batch, like
BatchNorm in training, or draws random numbers, like dropout), or when it changes a buffer in
every forward (it sees N updates per window instead of one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from gradaccum.torch.check.tracing import ModuleTrace

__all__ = ["Hazard", "empty_micro_batches", "find_hazards", "for_ranks", "unused_on_ranks"]

Close = Callable[[torch.Tensor, torch.Tensor], bool]

BATCHNORM_FIX = ("window BatchNorm (one running-statistics update per window), GroupNorm "
                 "conversion (no batch statistics at all) or compound momentum: see docs/BATCHNORM.md")
RANDOM_FIX = ("none exact: the micro-batches draw other random numbers than the full batch, so "
              "the update has the same distribution, not the same value. Training is still "
              "correct; to check the rest of the model, set p=0 or put these modules in eval mode")
BUFFER_FIX = ("none built in: update the buffer once per window (from "
              "Accumulator.register_boundary_hook), or compound its momentum as "
              "docs/BATCHNORM.md does for BatchNorm")
BATCHNORM_RANKS_FIX = ("SyncBatchNorm (nn.SyncBatchNorm.convert_sync_batchnorm; CUDA only) for "
                       "statistics over every rank's micro-batch in the forward, and window BatchNorm "
                       "with sync=True for running statistics pooled over the ranks and the window; "
                       "GroupNorm conversion removes both: see docs/BATCHNORM.md")
UNUSED_FIX = ("DistributedDataParallel(model, find_unused_parameters=True) (ddp_kwargs= in "
              "check_equivalence), or freeze (requires_grad=False) or remove the parameters the "
              "loss does not use")
NO_ITEMS_FIX = ("pass the summed loss with reduction='sum' (acc.backward(loss_sum, n_items, "
                "reduction='sum') takes n_items=0), or give every micro-batch of every rank items "
                "(shuffle, or a sampler that spreads them)")
MIXING_FIX = ("none in gradaccum: make the module per-sample (for a normalization, GroupNorm or "
              "LayerNorm), or feed it the whole batch")


@dataclass(frozen=True)
class Hazard:
    """A module that breaks equivalence, why, and the gradaccum fix.

    Attributes:
        module: the module's qualified name (``"(model)"`` for the model itself).
        kind: the module's class name.
        problem: what differs between the full batch and the micro-batches.
        fix: what gradaccum offers, or why nothing exact exists.
    """

    module: str
    kind: str
    problem: str
    fix: str


def find_hazards(
    model: nn.Module,
    full: ModuleTrace,
    micro: ModuleTrace,
    steps: int,
    changed_buffers: Mapping[str, Sequence[str]],
    close: Close,
) -> list[Hazard]:
    """The modules of ``model`` that break equivalence, deepest first in model order.

    Args:
        model: the model as traced (its modules' names match the traces).
        full: the trace of the full-batch forward.
        micro: the trace of the ``steps`` micro-batch forwards.
        steps: the number of micro-batches.
        changed_buffers: module name -> names of its own buffers that the forward changed.
        close: whether two tensors agree within the check's tolerance.

    Returns:
        One :class:`Hazard` per offending module.
    """
    mixing = {name for name in full.calls if _mixes_samples(full, micro, name, steps, close)}
    random = {name for name in full.calls if full.drew_random(name)}
    # A container is only named when none of its children explains the difference.
    flagged = _deepest(mixing | random) | set(changed_buffers)
    hazards = []
    for name, module in model.named_modules():
        if name in flagged:
            problem, fix = _diagnose(module, name in random, list(changed_buffers.get(name, ())))
            hazards.append(Hazard(name or "(model)", type(module).__name__, problem, fix))
    return hazards


def _mixes_samples(full: ModuleTrace, micro: ModuleTrace, name: str, steps: int, close: Close) -> bool:
    """Inputs agree with the full batch's (concatenated over micro-batches), outputs do not."""
    calls, parts = full.calls[name], micro.calls.get(name, [])
    if len(parts) != steps * len(calls):
        return False  # called another number of times: nothing to line up
    per_forward = len(calls)
    for j, call in enumerate(calls):
        pieces = parts[j::per_forward]
        if not _agree(call.inputs, [p.inputs for p in pieces], close):
            continue
        if not _agree(call.outputs, [p.outputs for p in pieces], close):
            return True
    return False


def _agree(whole: list[torch.Tensor], pieces: list[list[torch.Tensor]], close: Close) -> bool:
    if any(len(p) != len(whole) for p in pieces):
        return False
    return all(close(t, torch.cat([p[i] for p in pieces])) for i, t in enumerate(whole))


def _deepest(names: set[str]) -> set[str]:
    return {n for n in names if not any(o != n and (n == "" or o.startswith(n + ".")) for o in names)}


def _diagnose(module: nn.Module, drew_random: bool, buffers: list[str]) -> tuple[str, str]:
    if isinstance(module, _BatchNorm):
        problem = "in training it normalizes each micro-batch with that micro-batch's mean and variance"
        if buffers:
            problem += f", and updates {', '.join(buffers)} N times per window instead of once"
        return problem, BATCHNORM_FIX
    if isinstance(module, _DropoutNd):
        return (f"draws a new dropout mask (p={module.p}) for every micro-batch: other masks than "
                "the full batch's", RANDOM_FIX)
    if drew_random:
        return "draws random numbers in its forward: the micro-batches get other draws", RANDOM_FIX
    if buffers:
        return (f"changes its buffer(s) {', '.join(buffers)} in every forward: N updates per "
                "window instead of one", BUFFER_FIX)
    return ("its output for a sample depends on the other samples of its batch (batch "
            "statistics, in-batch pairs, ...)", MIXING_FIX)


def empty_micro_batches(counts: Sequence[float], steps: int, world_size: int) -> list[Hazard]:
    """The micro-batches whose item count is 0 (micro-batch ``i`` of the W*N is rank ``i // N``'s)."""
    hazards = []
    for i, n in enumerate(counts):
        if n == 0:
            where = f"rank {i // steps}, micro-batch {i % steps}" if world_size > 1 else f"micro-batch {i}"
            hazards.append(Hazard(f"({where})", "no items", "its loss returned n_items=0: a mean over "
                                  "no items is 0/0, and acc.backward refuses it", NO_ITEMS_FIX))
    return hazards


def for_ranks(hazards: list[Hazard], model: nn.Module) -> list[Hazard]:
    """The hazards as they read across ranks: a BatchNorm's statistics are also per rank."""
    modules = dict(model.named_modules())
    out = []
    for h in hazards:
        if isinstance(modules.get("" if h.module == "(model)" else h.module), _BatchNorm):
            h = Hazard(h.module, h.kind, h.problem + "; across ranks each rank normalizes with its own "
                       "micro-batch's statistics, and DDP broadcasts rank 0's buffers at every forward",
                       BATCHNORM_RANKS_FIX)
        out.append(h)
    return out


def unused_on_ranks(model: nn.Module, got_grad: Sequence[set[str]]) -> list[Hazard]:
    """The modules whose parameters received no gradient on some rank (DDP's reducer then waits
    for them: the bucket holding them is never all-reduced)."""
    hazards = []
    for name, module in model.named_modules():
        own = [(p_name, f"{name}.{p_name}" if name else p_name)
               for p_name, p in module.named_parameters(recurse=False) if p.requires_grad]
        missing = [p_name for p_name, full in own if any(full not in got for got in got_grad)]
        if missing:
            ranks = [str(r) for r, got in enumerate(got_grad)
                     if any(full not in got for _, full in own)]
            hazards.append(Hazard(name or "(model)", type(module).__name__,
                                  f"its parameter(s) {', '.join(missing)} received no gradient on rank"
                                  f"{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}: DDP waits "
                                  "for them, so the gradient bucket "
                                  "holding them is never all-reduced and each rank keeps its own "
                                  "gradients for that bucket's parameters", UNUSED_FIX))
    return hazards
