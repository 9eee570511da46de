"""The commonest porting mistakes, caught: your own ``optimizer.step()``, ``zero_grad()`` or
``scheduler.step()`` beside the accumulator's.

A hand-written loop ported to the accumulator often keeps its ``optimizer.step()``,
``optimizer.zero_grad()`` and ``scheduler.step()`` lines. Mid-window, the first applies a partial
gradient (scaled by ``1/N``) and the second throws the window's gradient away; the third steps a
scheduler the accumulator steps too. Nothing fails, the training is just wrong. Cheap guards:

* a **step pre-hook** on the optimizer refuses a step the accumulator does not make while its
  window is open, or inside a ``micro_batch()`` block (a window's first micro-batch too: with
  ``steps=1`` it would step twice): a ``RuntimeError`` before the optimizer changes anything. (A
  step after a boundary, with every gradient ``None``, changes nothing and passes.)
* every parameter's gradient (``torch/_window_grads.py``): none left over at a window's first
  micro-batch; between the accumulator's calls none changed (its version counter read after each
  micro-batch and compared before the next: ``zero_grad()``, ``zero_grad(set_to_none=False)``,
  per-micro-batch clipping, ``grad.mul_``); before the last, each still the tensor recorded. The
  next micro-batch is refused before its backward. A read of one attribute per gradient per
  micro-step, no kernel, nothing left on the parameters.
* the **scheduler** given as ``scheduler=``: its ``last_epoch`` (an int) is read after the
  accumulator's own step (or at the first window's first micro-batch), and again at the next
  window's first micro-batch and at the boundary, before anything changes. A count that moved
  forward in between is a ``scheduler.step()`` of your own: ``RuntimeError``, naming the fix. A
  scheduler without an integer ``last_epoch`` is not checked; ``load_state_dict`` starts over (a
  scheduler's state is loaded beside it). The children of a ``SequentialLR`` or
  ``ChainedScheduler`` are counted alike (one stepped directly). While the accumulator steps it,
  :func:`stepping_accumulator` names the accumulator, so a wrapper that gates a scheduler's
  ``step`` lets that call through (the Accelerate adapter's gate).
* the **learning rates**, read at a window's first micro-batch and compared at its boundary
  (``torch/_rates.py``): one changed inside the window is refused, the window dropped.
* **parameter groups** added inside a window that hold gradients are refused at its boundary
  (``torch/_param_groups.py``); :meth:`Guard.adopt` takes groups added between windows.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NoReturn

import torch

from gradaccum.torch._hooks import hook_optimizer, retire
from gradaccum.torch._param_groups import refuse_added_inside
from gradaccum.torch._rates import child_counts, child_stepped, rate_change, read_rates, schedule_count
from gradaccum.torch._window_grads import WindowGrads

__all__ = ["Guard", "exact_grads", "refuse_entry", "stepping_accumulator"]

# The accumulator whose boundary is stepping its scheduler now (Guard.step_scheduler), or None.
_STEPPING: ContextVar[Any] = ContextVar("gradaccum_stepping_scheduler", default=None)


def stepping_accumulator() -> Any:
    """The accumulator whose boundary is stepping its ``scheduler=`` right now, or None.

    For a wrapper put in place of a scheduler's ``step`` that passes only the accumulator's own
    call (integrations/accelerate.py).
    """
    return _STEPPING.get()


class Guard:
    """The guards of one accumulator.

    Args:
        owner: the accumulator (held weakly; its ``micro_step`` and ``steps`` are read).
        optimizer: the optimizer it steps.
        params: its parameters, in order.
        scheduler: its ``scheduler=``, or None.
        model: its ``model=`` (names parameters in messages), or None.
        exact: no cross-rank reduction rewrites ``.grad`` before a window's last micro-batch.
    """

    def __init__(self, owner: Any, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 scheduler: Any = None, model: Any = None, exact: bool = True) -> None:
        self._params = params
        # Weakly: the optimizer holds the step hook, which holds this guard (a strong reference
        # would make a cycle, freed only by the cyclic collector, at a time no one chooses).
        self._optimizer = weakref.ref(optimizer)
        self._model = model
        self._own = False
        self.in_block = False  # a micro_batch() block is feeding (_micro_batch.feed_block sets it)
        self.grads = WindowGrads(params, model, exact)
        # The per-micro-step calls go straight to the gradient checks (no call between: the hot
        # path's Python calls stay 0.3.0's). note(): after a micro-batch, the gradients as it left
        # them; check(micro_step, steps): before a later one, raises if they changed outside the
        # accumulator since (and, before the last, if one was cleared or replaced).
        self.note = self.grads.note
        self.check = self.grads.check
        self._scheduler_ref = _weakly(scheduler)  # weakly, as the optimizer: no cycle through the hook
        self._scheduled: int | None = None  # the scheduler's last_epoch as the accumulator left it
        self._children: list[tuple[Any, int]] = []  # a SequentialLR's (ChainedScheduler's) own, alike
        self._rates: list[Any] | None = None  # the learning rates at the window's first micro-batch
        ref = weakref.ref(owner)
        self._owner = ref

        def refuse_foreign_step(opt: Any, args: Any, kwargs: Any) -> None:
            acc = ref()
            if self._own or acc is None or not (acc.micro_step or self.in_block):
                return
            where = (f"an open window ({acc.micro_step} of {acc.steps} micro-batches)" if not self.in_block
                     else f"an acc.micro_batch() block (micro-batch {acc.micro_step + 1} of {acc.steps})")
            raise RuntimeError(
                f"optimizer.step() was called inside {where}: the accumulator steps the optimizer "
                "itself when a window completes (and clears the gradients after it). Remove your "
                "optimizer.step() and optimizer.zero_grad() calls; nothing was stepped")

        # A wrapper (Accelerate's AcceleratedOptimizer) steps the optimizer it wraps: hook that one.
        self._handle = hook_optimizer(optimizer,
                                      lambda inner: inner.register_step_pre_hook(refuse_foreign_step))

    @contextmanager
    def own_step(self, defer: Callable[[str], None] | None = None) -> Iterator[None]:
        """The accumulator's own boundary: its optimizer step passes the hook (a scheduler
        stepped outside it is refused first; with ``defer``, a pipeline's, that refusal is handed
        to ``defer`` instead, and the boundary raises it on every rank together)."""
        then = "this window is dropped: its gradients are cleared"
        try:
            self.check_scheduler(then)
            self._check_rates(then)
            refuse_added_inside(self._optimizer(), self._params)
        except RuntimeError as e:
            if defer is None:
                raise
            defer(str(e))
        self._own = True
        try:
            yield
        finally:
            self._own = False
            self._rates = None

    def check_first(self) -> None:
        """Before a window's first micro-batch: no stale gradient, no scheduler step of yours.

        Raises:
            RuntimeError: naming what was found and the fix; nothing has changed.
        """
        self.grads.check_clean()
        if self._scheduled is None:
            self.scheduled()
        else:
            self.check_scheduler("nothing has changed")
        self._rates = read_rates(self._optimizer())  # compared at the boundary: no change inside the window

    def resume(self, micro_step: int) -> None:
        """After ``load_state_dict``: record the loaded window's gradients (none when empty);
        the scheduler's count is read again at the next window."""
        self.forget()
        self._scheduled = None
        if micro_step:
            self.grads.note()

    def set_exact(self, exact: bool) -> None:
        """The accumulator's sync changed (a pipeline attached at its first ``backward_pipeline``):
        whether a reduction rewrites ``.grad`` before a window's last micro-batch, anew."""
        self.grads.exact = exact

    def forget(self) -> None:
        """The window closed or was dropped: nothing to compare before its first micro-batch."""
        self.grads.forget()

    @property
    def _scheduler(self) -> Any:
        """The ``scheduler=`` (None when none was given)."""
        return self._scheduler_ref()

    def step_scheduler(self, scheduler: Any) -> None:
        """The accumulator's own ``scheduler.step()``, its count remembered (also if it raises);
        :func:`stepping_accumulator` names the accumulator while it runs."""
        token = _STEPPING.set(self._owner())
        try:
            scheduler.step()
        finally:
            _STEPPING.reset(token)
            self.scheduled()

    def adopt(self, params: Sequence[torch.Tensor]) -> None:
        """Guard ``params`` from here (the optimizer gained a parameter group), as a new
        accumulator would: before a window's first micro-batch, nothing of a window recorded."""
        self.forget()
        self._params = params
        self.grads = WindowGrads(params, self._model, self.grads.exact)
        self.note, self.check = self.grads.note, self.grads.check

    def scheduled(self) -> None:
        """Remember the scheduler's count (and its children's) as the accumulator leaves it; the
        window's learning rates are read again at its next first micro-batch."""
        self._rates = None
        if self._scheduler is not None:
            self._scheduled = schedule_count(self._scheduler)
            self._children = child_counts(self._scheduler)

    def check_scheduler(self, then: str) -> None:
        """Raise if the scheduler moved since the accumulator left it (``then``: what the error
        leaves behind).

        Raises:
            RuntimeError: naming the fix.
        """
        seen = self._scheduled
        if seen is None:
            return
        now = schedule_count(self._scheduler)
        if now is None or now <= seen:
            self._check_children(then)
            return
        self._scheduled = now  # said once: the next window is checked from here
        raise RuntimeError(
            f"scheduler.step() was called outside the accumulator: the scheduler's last_epoch is {now}, "
            f"its step at the last boundary left it at {seen} (its learning rate is now {now - seen} "
            "step(s) ahead). Accumulator(..., scheduler=...) steps it once per optimizer step itself: "
            "remove your own scheduler.step(), or do not pass scheduler= (and step it when "
            f"acc.backward() returns True); {then}")

    def _check_children(self, then: str) -> None:
        """Raise if a child of the ``scheduler=`` (a ``SequentialLR``'s) was stepped directly.

        Raises:
            RuntimeError: naming the fix (said once: the next window is checked from here).
        """
        refusal = child_stepped(self._scheduler, self._children, then)
        if refusal is not None:
            self.scheduled()
            raise RuntimeError(refusal)

    def _check_rates(self, then: str) -> None:
        """At the boundary: raise if a learning rate changed since the window's first micro-batch
        (torch/_rates.py).

        Raises:
            RuntimeError: naming the group, both rates and the fix.
        """
        refusal = None if self._rates is None else rate_change(self._rates, self._optimizer(), then)
        if refusal is not None:
            self._rates = None
            raise RuntimeError(refusal)

    def remove(self) -> None:
        """Retire the step hook (a no-op once its accumulator is gone); it is taken off the
        optimizer when the next accumulator is made."""
        retire(self._handle)


def _weakly(obj: Any) -> Callable[[], Any]:
    """A callable giving ``obj`` back: a weak reference where ``obj`` takes one."""
    try:
        return weakref.ref(obj) if obj is not None else lambda: None
    except TypeError:  # an object without weak references: held strongly
        return lambda: obj


def exact_grads(sync: Any) -> bool:
    """True when nothing but the accumulator's backward passes changes ``.grad`` before a window's
    last micro-batch: no reduction in every backward (``sync="micro_batch"``), nor one the
    accumulator does not control (``sync="local"`` under a process group of several ranks, where
    a DDP model not given as ``model=`` reduces each backward itself)."""
    if sync.world_size > 1 or getattr(sync, "pipeline", False):  # a pipeline reduces at its boundary
        return getattr(sync, "mode", "window") != "micro_batch"
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def refuse_entry(method: str) -> NoReturn:
    """Refuse a feeding call (or flush) while another one of the same accumulator runs.

    Raises:
        RuntimeError: always, naming the two ways in and the fix; nothing has changed.
    """
    raise RuntimeError(
        f"acc.{method}() was called while another call of this accumulator is still running: from "
        "another thread (an Accumulator is not thread-safe: feed it from one thread, and hand it "
        "the losses through a queue if they are computed elsewhere), or from inside its own "
        "acc.micro_batch() block (use mb.backward() there). Nothing has changed") from None
