"""The commonest porting mistake, caught: your own ``optimizer.step()`` or ``zero_grad()`` inside an
open window.

A hand-written loop ported to the accumulator often keeps its ``optimizer.step()`` and
``optimizer.zero_grad()`` lines. Mid-window, the first applies a partial gradient (scaled by
``1/N``) and the second throws the window's gradient away; nothing fails, the training is just
wrong. Two cheap guards:

* a **step pre-hook** on the optimizer refuses a step the accumulator does not make while its
  window is open: a ``RuntimeError`` before the optimizer changes anything. (A step after a
  boundary, with every gradient ``None``, changes nothing and passes.)
* a **probe** on one parameter's ``.grad``: its version counter is read after each micro-batch's
  backward and compared before the next one. ``zero_grad()`` (``None``), ``zero_grad(set_to_none=
  False)`` or an in-place change such as per-micro-batch clipping shows as another version, and
  the next micro-batch is refused before its backward. Reads of two attributes per micro-step, no
  kernel. Where the window's gradients do not live in ``.grad`` (FSDP2 with ``sync="window"``,
  ``accum_dtype`` buffers), the probe finds no gradient and checks nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["Guard"]

# Hooks of dropped accumulators, taken off when the next Guard is made: an accumulator can be
# collected while the optimizer iterates over its hooks (a collection triggered inside one),
# where removing a hook would change the dict being iterated.
_RETIRED: list[Any] = []


class Guard:
    """The guards of one accumulator.

    Args:
        owner: the accumulator (held weakly; its ``micro_step`` and ``steps`` are read).
        optimizer: the optimizer it steps.
        params: its parameters, in order.
    """

    def __init__(self, owner: Any, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        self._params = params
        self._probe: torch.Tensor | None = None
        self._seen = -1  # the probe's .grad version after the last backward (-1: none)
        self._own = False
        ref = weakref.ref(owner)

        def refuse_foreign_step(opt: Any, args: Any, kwargs: Any) -> None:
            acc = ref()
            if self._own or acc is None or not acc.micro_step:
                return
            raise RuntimeError(
                f"optimizer.step() was called inside an open window ({acc.micro_step} of {acc.steps} "
                "micro-batches): the accumulator steps the optimizer itself when acc.backward() "
                "completes a window (and clears the gradients after it). Remove your "
                "optimizer.step() and optimizer.zero_grad() calls; nothing was stepped")

        # A wrapper (Accelerate's AcceleratedOptimizer) steps the optimizer it wraps: hook that one.
        inner: Any = optimizer
        while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
            inner = inner.optimizer
        while _RETIRED:
            _RETIRED.pop().remove()
        self._handle = inner.register_step_pre_hook(refuse_foreign_step)

    @contextmanager
    def own_step(self) -> Iterator[None]:
        """The accumulator's own boundary: its optimizer step passes the hook."""
        self._own = True
        try:
            yield
        finally:
            self._own = False

    def note(self) -> None:
        """After a micro-batch's backward: remember the probe's gradient version."""
        p = self._probe
        if p is None:
            p = self._probe = next((q for q in self._params if q.grad is not None), None)
            if p is None:
                return
        g = p.grad
        self._seen = -1 if g is None else g._version

    def forget(self) -> None:
        """The window closed or was dropped: nothing to compare before its first micro-batch."""
        self._seen = -1

    def check(self, micro_step: int, steps: int) -> None:
        """Before a later micro-batch's backward: raise if the window's gradients changed
        outside the accumulator since the last one.

        Raises:
            RuntimeError: naming the likely calls and what to do.
        """
        if self._seen < 0:
            return
        g = self._probe.grad  # type: ignore[union-attr]
        if g is not None and g._version == self._seen:
            return
        what = "cleared" if g is None else "changed in place"
        raise RuntimeError(
            f"the window's gradients were {what} outside the accumulator after micro-batch "
            f"{micro_step} of {steps}: optimizer.zero_grad() or model.zero_grad() (or clipping the "
            "gradients) inside an open window. The accumulator clears, clips and steps once per "
            "window, when acc.backward() completes it: remove those calls, then acc.discard() this "
            "window (its gradients are lost)")

    def remove(self) -> None:
        """Retire the step hook (a no-op once its accumulator is gone); it is taken off the
        optimizer when the next accumulator is made."""
        _RETIRED.append(self._handle)
