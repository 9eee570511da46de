"""``Accumulator.backward_pipeline``: one pipeline ``schedule.step()`` as one micro-batch of the window.

A ``torch.distributed.pipelining`` schedule splits the batch into its ``n_microbatches`` pipeline
micro-batches and backpropagates each one's loss inside ``step()``. So the weight of a pipeline
micro-batch in the window is put on its loss: for the call, the schedule's ``_compute_loss`` (where
it calls ``loss_fn`` on each micro-batch) is wrapped so that the loss it backpropagates is

* ``loss_fn(output, target) * count / P`` with ``reduction="mean"`` and ``n_items`` a function of
  the target chunk (each micro-batch's mean weighted by its own count),
* ``loss_fn(output, target) / P`` with ``reduction="sum"`` (a sum over the items already is
  ``count * mean``),
* ``loss_fn(output, target) / (N * n_microbatches)`` without ``n_items`` (a mean over every
  pipeline micro-batch of the window),

times a GradScaler's scale, where ``P`` is the window's provisional total (core/window.py: a power
of two near ``N`` times the count per call, or 1 where no gradient can overflow). Every stage's
gradient comes from these seeds; at the boundary every stage is corrected by ``P / T``, ``T`` the
window's true total over every call and data-parallel rank, which the one boundary all-reduce
brings to every rank (torch/pipeline/boundary.py). The ranks' agreement and the deferral of a
problem only one rank sees: torch/pipeline/checks.py.

The accumulator calls :func:`attach` at its first ``backward_pipeline`` (its sync becomes a
:class:`PipelineSync`, its boundary ``step_pipeline_window``), then :func:`feed` with its window
record and parts on every call, and commits the window :func:`feed` returns.
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from gradaccum.core.window import Window
from gradaccum.torch._precision import Precision
from gradaccum.torch._weights import wide_count
from gradaccum.torch.distributed.base import GradSync
from gradaccum.torch.pipeline.checks import CALL, FLUSH, Agreed, Call, check_call
from gradaccum.torch.pipeline.sync import PipelineSync, schedule_stages

__all__ = ["attach", "feed", "pow2_total"]


def pow2_total(count: float, size: int) -> float:
    """The provisional total of a pipeline window: the power of two in ``(size * count, 2 * size *
    count]`` (1 for no count), so that every seed ``count_i / P`` is exact.

    Example:
        >>> pow2_total(3, 4), pow2_total(0, 4)
        (16.0, 1.0)
    """
    x = float(count) * size
    if not (x > 0 and math.isfinite(x)):
        return 1.0
    return math.ldexp(1.0, math.frexp(x)[1])


def feed(sync: PipelineSync, schedule: Any, args: tuple[Any, ...], target: Any, n_items: Any,
         reduction: Any, kwargs: dict[str, Any], window: Window, precision: Precision,
         clip_norm: float | None, check_grads: Callable[[Window], None],
         before_step: Callable[[bool, Any], None] | None = None) -> Window:
    """Run ``schedule.step(*args, target=target, **kwargs)`` as one micro-batch of ``window``
    (``Accumulator.backward_pipeline`` documents the contract); return the window after it, for
    the accumulator to commit.

    Args:
        sync: the accumulator's :class:`PipelineSync` (:func:`attach`).
        window: the accumulator's window record; precision: its mixed-precision part;
            clip_norm: its ``clip_norm``.
        check_grads: the accumulator's gradient guards for a micro-batch of ``window`` (raises
            RuntimeError; recorded here as a problem of the call, not raised alone).
        before_step: called with (item-weighted, the provisional total ``P`` or None) once the
            ranks agreed, right before ``step()`` (the accumulator's feed hooks: gradaccum.moe).
    """
    n_mb = sync.n_microbatches = int(schedule._n_microbatches)
    call = check_call(sync, schedule, target, n_items, reduction, n_mb, window, check_grads)
    agreed = sync.agreed  # the schedule and window record the last call left (identity, not value)
    if sync.every_call or agreed is None or agreed[0] is not schedule or agreed[1] is not window:
        if agreed is not None and agreed[1] is not window:
            sync.poison = []  # the window was replaced (load_state_dict): its problems went with it
        sync.weights = _agree(sync, call, _pairs(CALL, window.size, window.micro_step, n_mb, sync,
                                                  precision, clip_norm), precision)
    elif call.problems:
        sync.poison += call.problems.items()
    weights: Agreed = sync.weights
    scale = window.scale if window.micro_step else (
        pow2_total(window.basis or weights.first_count or 1, window.size) if weights.use_scale else None)
    if before_step is not None:
        before_step(weights.items, scale)
    losses = kwargs.get("losses")
    collect = precision.collect if precision.buffers is not None else None
    try:
        with sync.controlled(collect), _weighted(precision, schedule, call, scale, window.size * n_mb):
            schedule.step(*args, target=target if target is not None or not call.last else _dummy(n_mb),
                          **kwargs)
    except BaseException:
        sync.agreed = None  # its gradients are partly accumulated (discard() drops them): agree again
        raise
    if isinstance(losses, list):  # the schedule's own list: the losses as loss_fn returned them
        losses[:] = call.raw
    return _advance(window, call, scale)


def attach(schedule: Any, sync: GradSync, params: list[torch.Tensor], precision: Precision,
           window: Window, acc: Any) -> PipelineSync:
    """The :class:`PipelineSync` that replaces an accumulator's ``sync`` at its first
    ``backward_pipeline`` call, made from ``schedule``.

    Args:
        sync: the accumulator's sync until now (its mode is kept).
        params: the optimizer's parameters; precision: the accumulator's mixed-precision part;
            window: its window record.
        acc: the accumulator, held weakly: its public ``schedule``, ``epoch``, ``optimizer_steps``
            (the next window's size), ``steps``, ``micro_step`` and ``clip_norm`` (what a
            ``flush()`` agrees on) are read when needed.

    Raises:
        TypeError: ``schedule`` is no ``torch.distributed.pipelining`` schedule.
        RuntimeError: this torch's schedules lack the internals the feed wraps.
    """
    stages = schedule_stages(schedule)
    if not hasattr(schedule, "_compute_loss") or not hasattr(schedule, "_n_microbatches") or not all(
            _takes_last_backward(stage) for stage in stages):
        raise RuntimeError(f"backward_pipeline needs torch.distributed.pipelining's schedule internals "
                           "(_compute_loss, _n_microbatches, a stage's backward_maybe_with_nosync("
                           f"..., last_backward)), which torch {torch.__version__} lacks (tested on torch "
                           "2.13): install that torch, or file an issue naming yours")
    device = params[0].device if params else torch.device(stages[0].device)
    new = PipelineSync(stages, getattr(sync, "mode", "window"), device)
    new.wide_buffers = precision.buffers is not None and new.world_size > 1
    for dp in new.dp:
        if hasattr(dp.module, "require_backward_grad_sync"):
            # DDP: the stage arms the all-reduce of a step()'s last backward itself; off, DDP's own
            # forward arms nothing (the schedule's first step() infers its metadata through it).
            dp.module.require_backward_grad_sync = False
    owned = {id(p) for s in stages for p in s.submod.parameters()}
    new.foreign = sum(id(p) not in owned for p in params)
    ref = weakref.ref(acc)

    def next_size() -> int:
        a = ref()
        if a is None:
            return 0
        return int(a.schedule(a.epoch if a.schedule.by == "epoch" else a.optimizer_steps + 1))

    def flush_pairs() -> list[float]:
        a: Any = ref()  # alive: this is its flush()
        return _pairs(FLUSH, a.steps, a.micro_step, new.n_microbatches, new, precision, a.clip_norm)

    new.next_size = next_size
    new.flush_pairs = flush_pairs
    precision.scale(torch.zeros((), device=device))  # an active scaler's scale exists on every stage
    new.prepare(window.next_is_last)
    return new


def _takes_last_backward(stage: Any) -> bool:
    """The stage's ``backward_maybe_with_nosync`` has the ``last_backward`` argument the sync's
    wrapper turns off off the window's last call (torch/pipeline/sync.py)."""
    method = getattr(stage, "backward_maybe_with_nosync", None)
    try:
        params = list(inspect.signature(method).parameters) if method is not None else []
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 and params[2] == "last_backward"


def _agree(sync: PipelineSync, call: Call, pairs: list[float], precision: Precision) -> Agreed:
    """The MAX all-reduce before a ``step()`` (the run's first call, after a restore, or every call
    with ``PipelineSync.every_call``)."""
    first = 0.0 if sync.weights is None else sync.weights.first_count
    overflow_prone = precision.overflow_prone
    if sync.weights is None and call.last and call.items and not call.problems and overflow_prone:
        first = _host_count(_first_count(call))
    last = [sync.has_last, call.last and call.items, call.last and call.summed, first,
            overflow_prone, bool(sync.poison)]
    return sync.agree(pairs, last, call.problems)


def _pairs(operation: int, size: int, micro_step: int, n_mb: int, sync: PipelineSync, precision: Precision,
           clip_norm: float | None) -> list[float]:
    """What every rank must hold alike (torch/pipeline/checks.py's pairs), in their order."""
    return [operation, size, micro_step, n_mb, sync.n_stages, precision.scaler is not None,
            -1.0 if clip_norm is None else clip_norm, precision.skip_nonfinite]


def _first_count(call: Call) -> Any:
    """The run's first call's count, for the first window's ``P`` (a function of the target is
    given the whole batch's target: any positive value would do, ``P`` cancels)."""
    n = call.n_items
    return n(call.target) if callable(n) else n


def _host_count(n: Any) -> float:
    return float(n.detach().double().sum()) if isinstance(n, torch.Tensor) else float(n)


class _weighted:
    """For one ``step()``: the schedule's ``_compute_loss`` weighs each micro-batch's loss."""

    def __init__(self, precision: Precision, schedule: Any, call: Call, scale: Any,
                 micro_batches: int) -> None:
        self.schedule, self.call, self.scaled = schedule, call, precision.scale  # by an active scaler
        self.inv = None if scale is None else 1.0 / scale
        self.mean = 1.0 / micro_batches  # a mean over every pipeline micro-batch of the window

    def __enter__(self) -> None:
        self.real_scale_grads = self.schedule.scale_grads
        self.schedule.scale_grads = False  # refused at the agreement; a later change is ignored
        self.schedule._compute_loss = self.compute_loss

    def __exit__(self, *exc: Any) -> None:
        vars(self.schedule).pop("_compute_loss", None)
        self.schedule.scale_grads = self.real_scale_grads

    def compute_loss(self, output: Any, target: Any,
                     loss_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
        call = self.call
        if call.problems:  # a harmless step: a zero loss through the output (no label needed)
            return sum((t.sum() for t in tree_leaves(output)
                        if isinstance(t, torch.Tensor) and t.requires_grad), torch.zeros(())) * 0.0
        raw = self.schedule._loss_fn(output, target, **(loss_kwargs or {}))
        call.raw.append(raw)
        loss = _weigh(raw, call, target, self.inv, self.mean)
        return self.scaled(loss)


def _weigh(raw: torch.Tensor, call: Call, target: Any, inv: float | None, mean: float) -> torch.Tensor:
    """One pipeline micro-batch's loss times its weight in the window (module docstring)."""
    detached = raw.detach()
    n = call.n_items
    if n is None:
        call.parts.append((detached, 1))
        return raw * mean
    count = n(target) if callable(n) else n
    call.counts.append(count)
    if call.summed:
        call.parts.append((detached, 1))
        return raw if inv is None else raw * inv
    call.parts.append((detached, count))
    loss: torch.Tensor = raw * count
    return loss if inv is None else loss * inv


def _advance(window: Window, call: Call, scale: Any) -> Window:
    """The window after this call: on the last stage its count total and losses; elsewhere only
    the step (the boundary all-reduce brings every rank the last stage's totals)."""
    if not call.last or call.problems:
        term = 0 if window.weighting == "items" else None
        return window.advance(term, scale=scale)
    if not call.items:
        return window.advance(None, scale=scale, losses=tuple(call.parts))
    counts = call.counts if not call.summed or callable(call.n_items) else [call.n_items]
    total = _total(counts)
    joins = not window.micro_step or not isinstance(window.items, torch.Tensor)
    if isinstance(total, torch.Tensor) and joins:
        total = wide_count(total)
    return window.advance(total, scale=scale, summed=call.summed, losses=tuple(call.parts))


def _total(counts: list[Any]) -> Any:
    if not any(isinstance(c, torch.Tensor) for c in counts):
        return sum(counts)
    total = counts[0]
    for c in counts[1:]:
        total = total + c
    return total


def _dummy(n_mb: int) -> torch.Tensor:
    """A target the schedule can split while the last stage's missing target is being reported."""
    return torch.zeros(n_mb)
