"""Every parameter's gradient, checked once per window: nothing left over at its start, nothing
changed outside the accumulator before its end.

* **Stale gradients.** The accumulator clears ``.grad`` (``set_to_none=True``) at every boundary,
  ``discard()`` and load of an empty window, so at a window's first micro-batch a nonzero
  gradient was put there by something else: your own ``loss.backward()`` before the loop, ``.grad``
  left over from evaluation, a micro-batch that raised half-way and was not discarded. It would
  be added into the window silently (2x on the first window). :meth:`WindowGrads.check_clean`
  refuses that micro-batch before its backward; a zero gradient (``zero_grad(set_to_none=
  False)``) passes. Cost: one pass reading each ``.grad`` (no kernel); a read of the values (a
  kernel and a host read) only for a gradient that is present, which after the accumulator's own
  boundary none is.
* **Every gradient, once per window.** The per-micro-step probe (``torch/_guards.py``) watches one
  parameter. After the window's first micro-batch :meth:`WindowGrads.record` keeps, for every
  parameter, its ``.grad`` tensor and that tensor's version counter; before the window's last
  micro-batch (or ``flush()``), :meth:`WindowGrads.check` wants each to be the same tensor, its
  version advanced by at most the backward passes fed since (autograd adds into an existing
  ``.grad`` in place: one version per pass that reaches it, none for a pass that does not). A
  gradient cleared, replaced, or changed in place (``grad.mul_``, clipping) raises, naming the
  parameter, before the last micro-batch's backward. The count of passes is what the
  accumulator ran: one per ``backward``, one per ``mb.backward`` of a ``micro_batch`` block, one
  per chunk of a ``backward_cached`` call (each chunk's backward adds into the window's
  gradients in place), and one more there for a parameter ``loss_fn`` uses (its gradient is
  added in at the last chunk). No cross-rank reduction runs between the record and the check under
  ``sync="window"`` (DDP and FSDP2 reduce in the last micro-batch's backward, after it); under
  ``sync="micro_batch"`` (or ``sync="local"`` under a process group of several ranks, where a DDP
  model not given as ``model=`` reduces every backward itself) each reduction rewrites the
  gradients, and only a cleared gradient is caught. A gradient held outside ``.grad``
  (``accum_dtype`` buffers; FSDP2's unsharded sums under ``sync="window"``) is ``None`` when
  recorded, and not checked. An edit within the passes a parameter skipped (one unused in some
  micro-batches) goes unseen. Cost: two passes over the parameters per window, reading attributes
  (no kernel).
* **Passes that add more than once.** Reentrant activation checkpointing
  (``checkpoint(..., use_reentrant=True)``) runs a nested backward per checkpointed segment, so a
  parameter used in k segments (a shared layer, tied weights) takes k additions per pass. The
  first window's first micro-batch counts each parameter's additions
  (``register_post_accumulate_grad_hook``, removed after it): a parameter added into more often
  than the passes allow gets that many versions per pass, and the count is taken again at every
  later window's first micro-batch (the largest kept). Where no parameter does, it is never
  counted again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["WindowGrads"]


class WindowGrads:
    """The two once-per-window checks of one accumulator's gradients.

    Args:
        params: the optimizer's parameters, in order.
        model: the accumulator's ``model=`` (names the parameters in messages), or None.
        exact: no cross-rank reduction rewrites ``.grad`` before the window's last micro-batch
            (``torch/_guards.py``'s ``exact_grads``).
    """

    def __init__(self, params: Sequence[torch.Tensor], model: Any, exact: bool) -> None:
        self._params = params
        self._model = model
        self.exact = exact
        self._record: list[tuple[torch.Tensor, int] | None] | None = None
        self._at = 0  # micro-batches fed when the record was taken
        self._extra = 0  # backward passes beyond one per micro-batch since then
        self._more: dict[int, int] = {}  # id(parameter) -> passes into it beyond those
        self._learn = True  # count additions per pass at the next window's first micro-batch
        self._per_pass: dict[int, int] = {}  # parameter index -> additions per pass, when > 1
        self._counts: list[int] | None = None  # additions counted in this first micro-batch
        self._handles: list[Any] = []
        self._first: tuple[int, Sequence[torch.Tensor]] = (1, ())  # passes of the first micro-batch

    def check_clean(self) -> None:
        """At a window's first micro-batch, before its backward: no nonzero gradient is there.

        Raises:
            RuntimeError: naming the first parameter holding one, and the fix; nothing changed.
        """
        for i, p in enumerate(self._params):
            g = p.grad
            if g is None:
                continue
            local = getattr(g, "_local_tensor", g)  # an FSDP2 shard: no collective for a check
            if bool((local._values() if local.is_sparse else local).any()):
                raise RuntimeError(
                    f"{self._name(i)} already holds a nonzero gradient at the first micro-batch of a "
                    "window: a gradient the accumulator did not put there (your own loss.backward() "
                    "before the loop, .grad left over from evaluation, or a micro-batch that raised "
                    "half-way) would be added into this window. Call optimizer.zero_grad("
                    "set_to_none=True) before the loop (acc.discard() after a micro-batch that "
                    "raised); nothing has changed")
        if self._learn:
            self._count_additions()

    def _count_additions(self) -> None:
        """Count every parameter's additions into ``.grad`` during the first micro-batch."""
        self._stop_counting()
        counts = self._counts = [0] * len(self._params)

        def added(i: int) -> Callable[[torch.Tensor], None]:
            def hook(_: torch.Tensor) -> None:
                counts[i] += 1
            return hook

        self._handles = [p.register_post_accumulate_grad_hook(added(i))  # type: ignore[no-untyped-call]
                         for i, p in enumerate(self._params) if p.requires_grad and p.is_leaf]

    def _stop_counting(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def record(self, fed: int) -> None:
        """After the window's first micro-batch (``fed`` micro-batches in it, more after a load):
        keep every parameter's gradient tensor and its version (and what was counted)."""
        self._stop_counting()
        counts, self._counts = self._counts, None
        if counts is not None:
            self._learn_per_pass(counts)
        self._first = (1, ())
        self._record = [None if (g := p.grad) is None else (g, g._version) for p in self._params]
        self._at = fed
        self._extra = 0
        self._more = {}

    def _learn_per_pass(self, counts: list[int]) -> None:
        """Keep, for each parameter added into more often than the first micro-batch's passes,
        its additions per pass (the largest seen); none such: never count again."""
        passes, more = self._first
        extra = {id(p) for p in more}
        for i, (p, n) in enumerate(zip(self._params, counts, strict=True)):
            allowed = passes + (id(p) in extra)
            if n > allowed:
                self._per_pass[i] = max(self._per_pass.get(i, 1), -(-n // allowed))
        self._learn = bool(self._per_pass)

    def add_passes(self, passes: int, more: Sequence[torch.Tensor] = ()) -> None:
        """A micro-batch ran ``passes`` backward passes (``micro_batch``, ``backward_cached``), and
        one more into each parameter of ``more`` (``loss_fn``'s, in ``backward_cached``)."""
        if self._record is None:
            self._first = (passes, more)  # the window's first: what its additions are counted against
            return
        self._extra += passes - 1
        for p in more:
            self._more[id(p)] = self._more.get(id(p), 0) + 1

    def forget(self) -> None:
        """The window closed, was dropped or reloaded: no record (and no count running)."""
        self._record = None
        self._stop_counting()
        self._counts = None
        self._first = (1, ())

    def check(self, fed: int, steps: int) -> None:
        """Before the window's last micro-batch (or a flush), ``fed`` micro-batches in: every
        recorded gradient is the same tensor, changed by nothing but the passes since. The record
        is then dropped (a gradient a reduction replaces is not kept alive); kept if it raises.

        Raises:
            RuntimeError: naming the parameter and the fix.
        """
        record = self._record
        if record is None:
            return
        passes = fed - self._at + self._extra
        if self.exact:
            for p, was in zip(self._params, record, strict=True):
                if was is not None and ((g := p.grad) is not was[0]
                                        or not 0 <= g._version - was[1] <= passes):
                    break  # out of the plain bound: the exact one (extra passes, additions per pass)
            else:
                self._record = None
                return
            for i, (p, was) in enumerate(zip(self._params, record, strict=True)):
                if was is not None and ((g := p.grad) is not was[0]
                                        or not 0 <= g._version - was[1] <= self._allowed(i, passes)):
                    self._refuse(record, passes, fed, steps)
        elif any(was is not None and p.grad is None for p, was in zip(self._params, record, strict=True)):
            self._refuse(record, passes, fed, steps)
        self._record = None

    def _refuse(self, record: list[tuple[torch.Tensor, int] | None], passes: int, fed: int,
                steps: int) -> None:
        """Raise for the first parameter whose gradient the record does not explain."""
        for i, (p, was) in enumerate(zip(self._params, record, strict=True)):
            if was is None:
                continue
            g = p.grad
            if g is was[0]:
                if not self.exact or 0 <= g._version - was[1] <= self._allowed(i, passes):
                    continue
                what = "changed in place"
            elif g is None:
                what = "cleared (set to None)"
            elif not self.exact:
                continue
            else:
                what = "replaced by another tensor"
            raise RuntimeError(
                f"the gradient of {self._name(i)} was {what} outside the accumulator during this "
                f"window ({fed} of {steps} micro-batches fed): zero_grad(), clipping or scaling "
                "gradients yourself, or setting .grad, inside an open window. The accumulator "
                "clips and steps once per window, when acc.backward() completes it: remove that "
                "code, then acc.discard() this window (its gradients are lost)")

    def _allowed(self, i: int, passes: int) -> int:
        """The versions parameter ``i``'s gradient may have advanced: the window's passes and
        those into it beyond (``loss_fn``'s parameters), times its additions per pass."""
        bonus = self._more.get(id(self._params[i]), 0) if self._more else 0
        return (passes + bonus) * self._per_pass.get(i, 1)

    def _name(self, i: int) -> str:
        """``parameter 'fc.bias'`` when ``model=`` names it, else its index in the optimizer."""
        p = self._params[i]
        if self._model is not None:
            for name, q in self._model.named_parameters():
                if q is p:
                    return f"parameter {name!r}"
        return f"the optimizer's parameter {i} (shape {tuple(p.shape)})"
