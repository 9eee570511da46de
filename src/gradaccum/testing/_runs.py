"""The runs behind :mod:`gradaccum.testing`: a loop fed the same batch for W windows, each one
recording what the optimizer saw at every step (the gradient, the learning rate), how often the
scheduler stepped, and the clip norm of a gradaccum Accumulator that did the stepping."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from gradaccum.torch.accumulator import Accumulator
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


@dataclass(frozen=True)
class StepSeen:
    """One ``optimizer.step()``: each group's learning rate and each parameter's gradient."""

    lrs: tuple[float, ...]
    grads: dict[str, torch.Tensor]


@dataclass
class Trace:
    """What one run of W windows did.

    Attributes:
        params: every parameter (float64) after each window.
        steps: the optimizer steps taken in each window.
        scheduler_steps: ``scheduler.step()`` calls in each window.
        pre_clip: the reference's window gradient before clipping (the reference only).
        clip_norm: the ``clip_norm`` of a gradaccum Accumulator that stepped (None: none did, or it
            does not clip).
        accumulator: an Accumulator stepped the optimizer.
        error: what the step raised in a later window (the run stopped there; local runs only).
    """

    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    steps: list[list[StepSeen]] = field(default_factory=list)
    scheduler_steps: list[int] = field(default_factory=list)
    pre_clip: list[dict[str, torch.Tensor]] = field(default_factory=list)
    clip_norm: float | None = None
    accumulator: bool = False
    error: Exception | None = None


def build(job: Job) -> nn.Module:
    """A fresh model with the job's starting weights."""
    model: nn.Module = job.model()
    model.load_state_dict(job.state)
    return model


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, float64, by name (DDP's wrapped module unwrapped)."""
    inner = getattr(model, "module", model)
    return {n: p.detach().double().clone() for n, p in inner.named_parameters()}


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


def _stepping_accumulator() -> Accumulator | None:
    """The gradaccum Accumulator on the call stack of this ``optimizer.step()``, if any.

    Your step builds its Accumulator inside itself: the step it takes is the one moment the helper
    can see it, to read its public ``clip_norm`` (the nearest frame that holds one is the caller).
    """
    frame = inspect.currentframe()
    for _ in range(48):
        if frame is None:
            return None
        found = next((v for v in frame.f_locals.values() if isinstance(v, Accumulator)), None)
        if found is not None:
            return found
        frame = frame.f_back
    return None


class _Recorder:
    """Hooks one run's optimizer and scheduler for the length of the run."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, trace: Trace) -> None:
        self.model = model
        self.trace = trace
        self.handle = opt.register_step_pre_hook(self._seen)
        step = sched.step

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.trace.scheduler_steps[-1] += 1
            return step(*args, **kwargs)

        sched.step = counted

    def open_window(self) -> None:
        self.trace.steps.append([])
        self.trace.scheduler_steps.append(0)

    def _seen(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        lrs = tuple(float(g["lr"]) for g in opt.param_groups)
        self.trace.steps[-1].append(StepSeen(lrs, grads_of(self.model)))
        acc = _stepping_accumulator()
        if acc is not None:
            self.trace.accumulator = True
            self.trace.clip_norm = acc.clip_norm


def run_windows(job: Job, model: nn.Module, micro_batches: list[Any], *, keep_error: bool) -> Trace:
    """``job.step`` over ``micro_batches`` once per window, on one model and optimizer.

    Args:
        keep_error: stop at an exception raised after the first window and keep it in the trace
            (an earlier window may already explain it); otherwise it propagates.
    """
    opt, sched = _parts(job, model)
    trace = Trace()
    recorder = _Recorder(model, opt, sched, trace)
    try:
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
                trace.steps.pop()
                trace.scheduler_steps.pop()
                break
            if not job.takes_scheduler:
                with warnings.catch_warnings():  # "scheduler before optimizer": the step's to tell
                    warnings.simplefilter("ignore")
                    sched.step()
            trace.params.append(params_of(model))
    finally:
        recorder.handle.remove()
    return trace


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


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, float64, by name (zeros for None; DDP's module unwrapped)."""
    inner = getattr(model, "module", model)
    return {n: (p.grad.detach().double().clone() if p.grad is not None
                else torch.zeros_like(p, dtype=torch.float64)) for n, p in inner.named_parameters()}


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
