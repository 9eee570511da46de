"""What one run records while the step runs: at every ``optimizer.step()`` the gradient, the
learning rate and the parameters (against those the window opened with); the scheduler's steps;
the order of the window's backward passes, ``zero_grad()`` calls, scheduler steps and optimizer
steps; and, on ranks, the ``all_reduce`` calls the step makes on a gradient itself."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradaccum.torch.accumulator import Accumulator

__all__ = ["Recorder", "StepSeen", "Trace", "grads_of", "values_of"]


@dataclass(frozen=True)
class StepSeen:
    """One ``optimizer.step()``: each group's learning rate, each parameter's gradient and, where
    the step found the parameters moved since the window opened, their values (else empty)."""

    lrs: tuple[float, ...]
    grads: dict[str, torch.Tensor]
    moved: dict[str, torch.Tensor] = field(default_factory=dict)


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
        events: each window's ``("zero_grad", b)``, ``("scheduler", b)`` and ``("step", b)`` in
            order, ``b`` the backward passes that had reached the parameters by then in the window.
        starts: every parameter (float64) as each window opened.
        backwards: the backward passes that reached the parameters in each window.
        grad_reduces: each window's ``all_reduce`` calls on a parameter's ``.grad`` made by the
            step itself (their ops: ``"SUM"``, ...; ranks only).
    """

    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    steps: list[list[StepSeen]] = field(default_factory=list)
    scheduler_steps: list[int] = field(default_factory=list)
    pre_clip: list[dict[str, torch.Tensor]] = field(default_factory=list)
    clip_norm: float | None = None
    accumulator: bool = False
    error: Exception | None = None
    events: list[list[tuple[str, int]]] = field(default_factory=list)
    backwards: list[int] = field(default_factory=list)
    grad_reduces: list[list[str]] = field(default_factory=list)
    starts: list[dict[str, torch.Tensor]] = field(default_factory=list)


def values_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, float64, by name (DDP's wrapped module unwrapped)."""
    inner = getattr(model, "module", model)
    return {n: p.detach().double().clone() for n, p in inner.named_parameters()}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, float64, by name (zeros for None; DDP's module unwrapped)."""
    inner = getattr(model, "module", model)
    return {n: (p.grad.detach().double().clone() if p.grad is not None
                else torch.zeros_like(p, dtype=torch.float64)) for n, p in inner.named_parameters()}


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


class Recorder:
    """Hooks one run's optimizer, scheduler and parameters for the length of the run."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, trace: Trace) -> None:
        self.model = model
        self.trace = trace
        self.handles = [opt.register_step_pre_hook(self._seen)]
        self.counts: dict[int, int] = {}
        self.patched: list[tuple[Any, str]] = []
        step = sched.step

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.trace.scheduler_steps[-1] += 1
            if self.trace.events:
                self.trace.events[-1].append(("scheduler", self.backwards()))
            return step(*args, **kwargs)

        sched.step = counted
        inner = getattr(model, "module", model)
        for p in inner.parameters():
            if p.requires_grad:
                with contextlib.suppress(RuntimeError):  # a parameter that takes no hook is not counted
                    self.handles.append(p.register_post_accumulate_grad_hook(self._accumulated))
        for owner in (opt, model):
            self._count_zero_grad(owner)

    def _accumulated(self, p: torch.Tensor) -> None:
        self.counts[id(p)] = self.counts.get(id(p), 0) + 1

    def backwards(self) -> int:
        """The backward passes that reached the parameters in this window (the most any one saw)."""
        return max(self.counts.values(), default=0)

    def _count_zero_grad(self, owner: Any) -> None:
        zero_grad = owner.zero_grad

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.trace.events:
                self.trace.events[-1].append(("zero_grad", self.backwards()))
            return zero_grad(*args, **kwargs)

        try:
            object.__setattr__(owner, "zero_grad", counted)
        except (AttributeError, TypeError):  # no instance attributes (__slots__): not counted
            return
        self.patched.append((owner, "zero_grad"))

    def open_window(self) -> None:
        self.trace.steps.append([])
        self.trace.scheduler_steps.append(0)
        self.trace.events.append([])
        self.trace.grad_reduces.append([])
        self.trace.starts.append(values_of(self.model))
        self.counts.clear()

    def close_window(self) -> None:
        self.trace.backwards.append(self.backwards())

    def drop_window(self) -> None:
        trace = self.trace
        for seen in (trace.steps, trace.scheduler_steps, trace.events, trace.grad_reduces, trace.starts):
            seen.pop()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for owner, name in self.patched:
            with contextlib.suppress(AttributeError):
                object.__delattr__(owner, name)

    def _seen(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        lrs = tuple(float(g["lr"]) for g in opt.param_groups)
        now = values_of(self.model)
        start = self.trace.starts[-1] if self.trace.starts else now
        moved = now if any(not torch.equal(now[n], start[n]) for n in now if n in start) else {}
        self.trace.steps[-1].append(StepSeen(lrs, grads_of(self.model), moved))
        self.trace.events[-1].append(("step", self.backwards()))
        acc = _stepping_accumulator()
        if acc is not None:
            self.trace.accumulator = True
            self.trace.clip_norm = acc.clip_norm

    @contextlib.contextmanager
    def watching_all_reduce(self) -> Any:
        """Record the step's own ``torch.distributed.all_reduce`` calls on a parameter's gradient."""
        import torch.distributed as dist

        original = dist.all_reduce
        inner = getattr(self.model, "module", self.model)

        def watched(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            op = kwargs.get("op", args[0] if args else dist.ReduceOp.SUM)
            grads = [p.grad for p in inner.parameters() if p.grad is not None]
            # a gradient itself, or every gradient flattened into one buffer
            if any(g.data_ptr() == tensor.data_ptr() for g in grads) or (
                    tensor.is_floating_point() and grads and tensor.numel() == sum(g.numel() for g in grads)):
                self.trace.grad_reduces[-1].append(str(op).rsplit(".", 1)[-1])
            return original(tensor, *args, **kwargs)

        dist.all_reduce = watched
        try:
            yield
        finally:
            dist.all_reduce = original
