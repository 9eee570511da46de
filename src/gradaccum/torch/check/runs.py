"""The checker's two runs in one process: one SGD step on the full batch, and the same window
through an Accumulator over N micro-batches. Both record every module's forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from gradaccum.torch.accumulator import Accumulator
from gradaccum.torch.check.losses import LossFn, item_count, split_loss
from gradaccum.torch.check.samples import Batch
from gradaccum.torch.check.tracing import ModuleTrace, trace_modules

__all__ = ["Run", "full_step", "micro_steps", "micro_window"]


@dataclass
class Run:
    """What a run saw: its module trace, the loss values, their dtypes and item counts.

    Attributes:
        trace: every module's forward calls.
        losses: the loss value of each forward (one for the full batch, N for the micro-batches).
        dtypes: the loss's dtype for each forward.
        counts: the ``n_items`` of each forward; empty when the loss returned a bare mean.
    """

    trace: ModuleTrace = field(default_factory=ModuleTrace)
    losses: list[float] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)

    def record(self, value: torch.Tensor, n_items: object, where: str) -> None:
        """Note one forward's loss (a host read: the checker is not a hot path)."""
        self.losses.append(float(value.detach()))
        self.dtypes.append(value.dtype)
        if n_items is not None:
            self.counts.append(item_count(n_items, where))


def full_step(model: nn.Module, batch: Batch, targets: torch.Tensor, loss_fn: LossFn,
              device: torch.device) -> Run:
    """One SGD step (lr 1) on the whole batch.

    An item-weighted loss needs nothing more here: its value is already the mean over all items.
    """
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    run = Run()
    with trace_modules(model, batch.size, device) as run.trace:
        out = batch.run(model)
    value, n_items = split_loss(loss_fn(out, targets), "the full batch")
    run.record(value, n_items, "the full batch")
    torch.autograd.backward(value)
    opt.step()
    return run


def micro_steps(model: nn.Module, batch: Batch, targets: torch.Tensor, loss_fn: LossFn, steps: int,
                device: torch.device, weighted: bool) -> Run:
    """The window through an Accumulator over ``steps`` equal micro-batches, traced."""
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=1.0), steps)
    run = Run()
    with trace_modules(model, batch.size // steps, device) as run.trace:
        micro_window(acc, model, batch, targets, loss_fn, steps, weighted, run)
    return run


def micro_window(acc: Accumulator, model: nn.Module, batch: Batch, targets: torch.Tensor,
                 loss_fn: LossFn, steps: int, weighted: bool, run: Run) -> None:
    """Feed ``steps`` equal micro-batches of ``batch`` to ``acc`` (also each rank's window).

    A micro-batch whose loss counts 0 items is recorded but not fed, and the window is then
    discarded: the checker names it instead of failing on ``acc.backward``'s refusal.

    Raises:
        TypeError: the loss returned ``(loss, n_items)`` for some batches and a bare loss for
            others.
    """
    size = batch.size // steps
    for i in range(steps):
        where = f"micro-batch {i}"
        part = batch.part(i * size, (i + 1) * size)
        value, n_items = split_loss(loss_fn(part.run(model), targets[i * size:(i + 1) * size]), where)
        if (n_items is not None) != weighted:
            raise TypeError(f"loss returned {'a bare loss' if weighted else '(loss, n_items)'} on "
                            f"{where} but {'(loss, n_items)' if weighted else 'a bare loss'} on "
                            "the full batch: return the same form for every batch")
        run.record(value, n_items, where)
        if not (weighted and run.counts[-1] == 0):  # a mean over no items: named, not fed
            acc.backward(value, n_items)
    if weighted and 0 in run.counts:
        acc.discard()  # no update at all rather than a window without those micro-batches
