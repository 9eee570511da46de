"""The runs behind :mod:`gradaccum.testing`: a loop fed the same batch for W windows, each one
recorded by :class:`gradaccum.testing._record.Recorder` (what the optimizer saw at every step, the
scheduler's steps, the order of backward passes, ``zero_grad()`` calls and steps)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from gradaccum.testing._record import Recorder, StepSeen, Trace, grads_of, values_of
from gradaccum.torch.memory.split import batch_size, split_batch

__all__ = ["Job", "StepSeen", "Trace", "build", "full_batch_reference", "grads_of", "halve_each_window",
           "params_of", "run_split", "run_windows", "splits_on_rank"]

StepFn = Callable[..., Any]
LossFn = Callable[[nn.Module, Any], torch.Tensor]


def halve_each_window(optimizer_step: int) -> float:
    """The default schedule's LR factor: 1, 1/2, 1/4, ... (it changes at every window)."""
    return 0.5 ** optimizer_step


@dataclass(frozen=True)
class Job:
    """Everything a run needs; it travels by pickle to the ranks."""

    step: StepFn
    model: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None
    scheduler: Callable[[torch.optim.Optimizer], Any] | None
    state: dict[str, torch.Tensor]
    batch: Any
    sizes: list[tuple[int, ...]]
    seed: int
    world: int
    windows: int
    takes_scheduler: bool  # step(model, optimizer, micro_batches, scheduler=...) steps it itself
    names: tuple[str, ...] = ()  # the parameters, in order


def build(job: Job) -> nn.Module:
    """A fresh model with the job's starting weights."""
    model: nn.Module = job.model()
    model.load_state_dict(job.state)
    return model


params_of = values_of


def _parts(job: Job, model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    make = job.optimizer
    opt = make(model) if make is not None else torch.optim.SGD(model.parameters(), lr=1.0)
    if job.scheduler is not None:
        sched = job.scheduler(opt)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, halve_each_window)
    if not callable(getattr(sched, "step", None)):
        raise TypeError(f"make_scheduler must return an LR scheduler, got {type(sched).__name__}")
    return opt, sched


def run_windows(job: Job, model: nn.Module, micro_batches: list[Any], *, keep_error: bool) -> Trace:
    """``job.step`` over ``micro_batches`` once per window, on one model and optimizer.

    Args:
        keep_error: stop at an exception raised after the first window and keep it in the trace
            (an earlier window may already explain it); otherwise it propagates.
    """
    opt, sched = _parts(job, model)
    trace = Trace()
    recorder = Recorder(model, opt, sched, trace)
    try:
        with recorder.watching_all_reduce() if job.world > 1 else contextlib.nullcontext():
            _windows(job, model, opt, sched, micro_batches, recorder, keep_error)
    finally:
        recorder.remove()
    return trace


def _windows(job: Job, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, micro_batches: list[Any],
             recorder: Recorder, keep_error: bool) -> None:
    trace = recorder.trace
    for window in range(job.windows):
        recorder.open_window()
        try:
            if job.takes_scheduler:
                job.step(model, opt, micro_batches, scheduler=sched)
            else:
                job.step(model, opt, micro_batches)
        except Exception as err:
            if window == 0 or not keep_error:
                raise
            trace.error = err
            recorder.drop_window()
            return
        recorder.close_window()
        if not job.takes_scheduler:
            with warnings.catch_warnings():  # "scheduler before optimizer": the step's to tell
                warnings.simplefilter("ignore")
                sched.step()
        trace.params.append(params_of(model))


def full_batch_reference(job: Job, loss_fn: LossFn | None, clip_norm: float | None) -> Trace:
    """The full batch, one optimizer step per window: ``loss_fn`` on the whole batch, clipped at
    ``clip_norm``, or without ``loss_fn`` the step itself on the batch as one micro-batch (its
    gradients zeroed before each window, so that a stale one cannot hide in the reference)."""
    torch.manual_seed(job.seed)
    model = build(job)
    if loss_fn is None:
        def step(model: nn.Module, opt: torch.optim.Optimizer, micro: list[Any], **kw: Any) -> None:
            opt.zero_grad(set_to_none=True)
            job.step(model, opt, micro, **kw)
        return run_windows(_with_step(job, step), model, [job.batch], keep_error=False)
    pre_clip: list[dict[str, torch.Tensor]] = []

    def plain(model: nn.Module, opt: torch.optim.Optimizer, micro: list[Any], **kw: Any) -> None:
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss_fn(model, micro[0]))
        pre_clip.append(grads_of(model))
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        opt.step()

    trace = run_windows(_with_step(job, plain, takes_scheduler=False), model, [job.batch], keep_error=False)
    trace.pre_clip = pre_clip
    return trace


def _with_step(job: Job, step: StepFn, *, takes_scheduler: bool | None = None) -> Job:
    takes = job.takes_scheduler if takes_scheduler is None else takes_scheduler
    return replace(job, step=step, takes_scheduler=takes)


def run_split(job: Job, share: Any, sizes: Sequence[int], rank: int, *, keep_error: bool) -> Trace:
    """One split of ``share`` from the start: a fresh model, optimizer and scheduler."""
    torch.manual_seed(job.seed + rank)
    model = build(job)
    if job.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    return run_windows(job, model, split_batch(share, list(sizes)), keep_error=keep_error)


def splits_on_rank(rank: int, world: int, job: Job) -> list[Trace]:
    """Every split of this rank's share of the batch (the function the ranks run)."""
    share = batch_size(job.batch) // world
    mine = split_batch(job.batch, [share] * world)[rank]
    return [run_split(job, mine, sizes, rank, keep_error=world == 1) for sizes in job.sizes]
