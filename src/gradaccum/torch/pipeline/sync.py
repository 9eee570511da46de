"""Sync control for a pipeline stage (``torch.distributed.pipelining``): the ranks of one window.

A pipeline schedule runs the backward of every stage inside ``schedule.step()``; the stages'
gradients all come from the last stage's loss, and only the last stage knows the item counts. So
one window spans every pipeline rank (and, with data parallelism, every replica), and
:class:`PipelineSync` is what the accumulator asks for it (docs/PIPELINE.md):

* **the collectives**: one small all-reduce per window (:meth:`PipelineSync.all_reduce`, a
  single call over the whole pipeline x data-parallel world when that is the default group), and
  one MAX all-reduce when the ranks must agree before a ``step()`` (the run's first call, after a
  restore);
* **the data-parallel gradient reduction**: ``PipelineStage`` forces DDP's all-reduce in every
  ``step()``'s last backward and FSDP2's reduce-scatter at its end; while a window is open,
  :meth:`PipelineSync.controlled` lets only the window's last ``step()`` reduce (the schedule's
  ``backward_maybe_with_nosync`` and ``perform_reduce_grad`` of each local stage, wrapped for
  the duration of the call).

An FSDP2 stage's gradients are kept through the schedule's metadata inference, whose cleanup
would clear them (:func:`_keep_grads`). A plain module that may be a stage waits in
``distributed/selector.py``'s ``PendingSync`` until its first micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from gradaccum.torch.distributed.base import SyncMode
from gradaccum.torch.distributed.collectives import RankGroups
from gradaccum.torch.distributed.ddp import DDPSync
from gradaccum.torch.distributed.fsdp import FSDPSync
from gradaccum.torch.pipeline.checks import Agreed, agreement_vector, read_agreement

__all__ = ["PipelineSync", "schedule_stages"]


def schedule_stages(schedule: Any) -> list[Any]:
    """The pipeline stages a ``torch.distributed.pipelining`` schedule runs on this rank.

    Raises:
        TypeError: ``schedule`` is not such a schedule (it holds no stage).
    """
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = None if stage is None else [stage]
    if not stages or not hasattr(schedule, "step"):
        raise TypeError(f"schedule must be a torch.distributed.pipelining schedule (ScheduleGPipe, "
                        f"Schedule1F1B, ScheduleInterleaved1F1B, ...), got {type(schedule).__name__}")
    return list(stages)


def _data_parallel(stages: Sequence[Any], mode: SyncMode) -> list[DDPSync | FSDPSync]:
    """A sync per data-parallel stage module (DDP or FSDP2): for flush, discard and checkpoints."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    syncs: list[DDPSync | FSDPSync] = []
    for stage in stages:
        if isinstance(stage.submod, DistributedDataParallel):
            syncs.append(DDPSync(stage.submod, mode))
        elif isinstance(stage.submod, FSDPModule):
            syncs.append(FSDPSync(stage.submod, mode))
    return syncs


class PipelineSync:
    """The sync of an accumulator whose micro-batches are pipeline ``step()`` calls.

    Args:
        stages: this rank's pipeline stages (:func:`schedule_stages`).
        mode: ``"window"`` (data-parallel gradients reduced once per window) or
            ``"micro_batch"`` (in every ``step()``, as the schedule does by itself).
        device: where the small reduction vectors live.

    Attributes:
        world_size: the data-parallel replicas the gradients are averaged over (1 without DP).
        has_last: this rank holds the pipeline's last stage (where the loss and counts live).
        dp_lead: this rank's gradients count in the global norm (the first replica under DDP,
            whose replicas hold equal gradients; every shard under FSDP2).
    """

    pipeline = True  # the data-parallel reduction runs at the window's last call only (_guards.exact_grads)

    def __init__(self, stages: Sequence[Any], mode: SyncMode, device: torch.device) -> None:
        self.stages = list(stages)
        self.mode: SyncMode = "window" if mode == "local" else mode
        self.dp = _data_parallel(self.stages, self.mode)
        self.has_last = any(s.is_last for s in self.stages)
        self.n_stages = int(self.stages[0].num_stages)
        pp_group = self.stages[0].group
        pp_size = dist.get_world_size(pp_group)
        dp_groups = list(self.dp[0].groups) if self.dp else []
        self.world_size = math.prod(dist.get_world_size(g) for g in dp_groups) if dp_groups else 1
        self.sharded = bool(self.dp) and isinstance(self.dp[0], FSDPSync)
        self.fsdp_stages = [s for s in self.stages if any(isinstance(d, FSDPSync) and d.module is s.submod
                                                         for d in self.dp)]
        self.dp_lead = self.sharded or not self.dp or all(dist.get_rank(g) == 0 for g in dp_groups)
        for stage in self.stages:
            _keep_grads(stage)
        groups: list[Any]  # process groups (None: the default one)
        if pp_size * self.world_size == dist.get_world_size():
            groups = [dist.group.WORLD]  # one call over every pipeline and data-parallel rank
        else:
            groups = [pp_group, *dp_groups]
        world: Any = dist.group.WORLD
        self.ranks = RankGroups([world if g is None else g for g in groups], device, "window")  # pp x dp
        self.rank = dist.get_rank()
        self.reduce_next = False
        self.agreed: Any = None  # (schedule, window record) the last call left: no agreement needed
        self.weights: Any = None  # the agreed run facts (torch/pipeline/checks.py's Agreed)
        self.poison: list[tuple[str, str]] = []  # this window's deferred problems here: (code, detail)
        self.n_microbatches = 1  # the schedule's, set by each call
        self.next_size: Callable[[], int] = lambda: 0  # the next window's size (the accumulator's steps)
        self.wide_buffers = False  # accum_dtype under DDP: the boundary averages the float32 sums
        self.foreign = 0  # the optimizer's parameters in none of the stages
        self.flush_pairs: Callable[[], list[float]] = lambda: []  # what flush() agrees on
        # Agree before every call, not only the first (catches ranks that call a different number
        # of times, at one small all-reduce per call): under TORCH_DISTRIBUTED_DEBUG=INFO or DETAIL.
        self.every_call = c10d.get_debug_level() != c10d.DebugLevel.OFF

    # ------------------------------------------------------------------ the GradSync protocol
    def prepare(self, sync_next: bool) -> bool:
        """Whether the next call's ``step()`` reduces data-parallel gradients (the window's last)."""
        self.reduce_next = bool(self.dp) and (sync_next or self.mode == "micro_batch")
        return self.reduce_next

    def pause(self) -> None:
        """Not used by a pipeline feed."""

    def refuse_feed(self) -> None:
        """Raise: this accumulator's window is fed by ``backward_pipeline``.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError("this Accumulator feeds a pipeline schedule: call acc.backward_pipeline("
                           "schedule, *args, target=..., n_items=...) for every micro-batch of its "
                           "windows, not backward(), micro_batch() or backward_cached()")

    def sync_partial(self, params: Sequence[torch.Tensor], micro_steps: int) -> None:
        """``flush()`` on every rank: agree on the window's length, then reduce its gradients over
        the data-parallel replicas (the window's last ``step()`` did not).

        Raises:
            ValueError: the ranks hold windows of different lengths, or one recorded a bad
                input in this window (every rank raises, before anything changes).
        """
        agreed = self.agree(self.flush_pairs(), [self.has_last, 0, 0, 0, 0, bool(self.poison)], {})
        if agreed.poisoned or not micro_steps or self.mode == "micro_batch" or self.wide_buffers:
            # a poisoned window raises at the boundary; an empty one has nothing to reduce; wide
            # buffers (accum_dtype) are averaged over the replicas by the boundary itself
            return
        for dp in self.dp:
            if isinstance(dp, DDPSync):
                dp.sync_partial([p for p in dp.module.parameters()], micro_steps)
        for stage in self.fsdp_stages:
            stage.perform_reduce_grad(1)

    def reduce_window(self, loss_sum: Any, items: Any,
                      sums: Sequence[Any] = ()) -> tuple[Any, Any, list[Any]]:
        """Not used: the pipeline's boundary reduces its own vector (torch/pipeline/boundary.py)."""
        raise NotImplementedError

    def agree_count(self, count: Any) -> Any:
        """Not used: the run's first count is part of the pipeline's agreement."""
        raise NotImplementedError

    def check_saveable(self) -> None:
        """Raise where a partial window's gradients live inside FSDP2 (``sync="window"``)."""
        for dp in self.dp:
            dp.check_saveable()

    def check_forward(self) -> None:
        """The schedule calls the stage modules itself: nothing to check."""

    def defer(self, message: str) -> None:
        """A guard's refusal on this rank alone (an edited gradient, a scheduler stepped outside),
        recorded as the window's ``"gradients"`` problem: raised at the boundary on every rank
        together, where raising it here would leave the other ranks waiting in a collective."""
        self.poison.append(("gradients", message))

    def raise_deferred(self) -> None:
        """Not used: the pipeline's boundary raises what :meth:`defer` recorded (its vector)."""

    def discard(self) -> None:
        """Drop what a partial window left outside ``.grad`` (FSDP2) and its recorded problems."""
        self.poison = []
        for dp in self.dp:
            dp.discard()

    def average_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Average ``tensors`` over the data-parallel replicas (wide buffers under DDP)."""
        if self.dp:
            self.dp[0].average_(tensors)

    def max_over_ranks(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of ``values`` over every pipeline and data-parallel rank."""
        return self.ranks.max_over_ranks(values)

    # ------------------------------------------------------------------ the pipeline's own
    def agree(self, pairs: Sequence[float], last: Sequence[float], problems: dict[str, str]) -> Agreed:
        """One MAX all-reduce of every rank's :func:`agreement_vector`; raise on every rank if the
        ranks disagree or one recorded a problem (torch/pipeline/checks.py)."""
        values = agreement_vector(pairs, last, list(problems), self.rank)
        vec = torch.tensor(values, dtype=torch.float64, device=self.ranks.device)
        self.all_reduce(vec, dist.ReduceOp.MAX)
        return read_agreement(vec.tolist(), problems)

    def all_reduce(self, vec: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> None:
        """``vec`` reduced over every pipeline and data-parallel rank, in place."""
        self.ranks.all_reduce(vec, op)

    @property
    def reduces_in_backward(self) -> bool:
        """The stages' DDP/FSDP2 reduce the gradients themselves (not wide buffers at the boundary)."""
        return not self.wide_buffers

    @contextmanager
    def controlled(self, collect: Callable[[], None] | None) -> Iterator[None]:
        """Run one ``step()`` with the data-parallel reduction only where the window wants it.

        ``PipelineStage`` arms DDP's all-reduce in each ``step()``'s last backward and runs
        FSDP2's reduce-scatter in ``perform_reduce_grad``; both are passed on only when
        :meth:`prepare` said the coming call completes the window. ``collect`` (wide buffers)
        runs after every backward.
        """
        reduce = self.reduce_next and self.reduces_in_backward
        patched = []
        for stage in self.stages:
            if collect is not None or (self.dp and not reduce):
                real = stage.backward_maybe_with_nosync
                stage.backward_maybe_with_nosync = _backward(real, reduce, collect)
                patched.append((stage, "backward_maybe_with_nosync"))
            if not reduce and stage in self.fsdp_stages:
                stage.perform_reduce_grad = _skip
                patched.append((stage, "perform_reduce_grad"))
        try:
            yield
        finally:
            for stage, name in patched:
                vars(stage).pop(name, None)  # the class's method again


def _keep_grads(stage: Any) -> None:
    """Keep a stage's FSDP2 gradients through its schedule's metadata inference, for good.

    A schedule's first ``step()`` (and its first after ``schedule.eval()``) runs the stage once to
    infer shapes, then ``PipelineStage._post_metadata_inference_cleanup`` sets ``.grad = None`` on
    every parameter of the stage's FSDP2 modules: a partial window that ``load_state_dict``
    restored (``sync="micro_batch"``), or that a validation step interrupted, would be lost. The
    inference computes input gradients only (``torch.autograd.grad``), so what ``.grad`` held
    before it is what the window holds; the stage's method is replaced once, by one that restores
    it (installed for the stage's life: the ``eval()`` step runs outside any window's call).
    """
    from torch.distributed.fsdp import FSDPModule

    real = getattr(stage, "_post_metadata_inference_cleanup", None)
    if real is None or getattr(real, "keeps_grads", False):
        return  # an older torch without it, or wrapped by an earlier accumulator
    params = list({id(p): p for m in stage.submod.modules() if isinstance(m, FSDPModule)
                   for p in m.parameters()}.values())  # type: ignore[attr-defined]
    if not params:
        return

    def _post_metadata_inference_cleanup() -> None:
        kept = [(p, p.grad) for p in params]
        real()
        for p, grad in kept:
            p.grad = grad

    _post_metadata_inference_cleanup.keeps_grads = True  # type: ignore[attr-defined]
    stage._post_metadata_inference_cleanup = _post_metadata_inference_cleanup


def _skip(*args: Any, **kwargs: Any) -> None:
    """``perform_reduce_grad`` of an FSDP2 stage off the window's last call: its gradients stay
    unsharded and accumulate until that call reduce-scatters them."""


def _backward(real: Callable[..., Any], reduce: bool,
              collect: Callable[[], None] | None) -> Callable[..., Any]:
    """``real`` (a stage's ``backward_maybe_with_nosync``) with its ``last_backward`` (the third
    argument, given by position or name) passed on only when ``reduce``; anything else as given."""
    def backward_maybe_with_nosync(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 2:
            args = (*args[:2], bool(args[2]) and reduce, *args[3:])
        else:
            kwargs["last_backward"] = bool(kwargs.get("last_backward", False)) and reduce
        out = real(*args, **kwargs)
        if collect is not None:
            collect()
        return out

    return backward_maybe_with_nosync
