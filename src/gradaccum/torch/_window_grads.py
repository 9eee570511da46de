"""Every parameter's gradient, checked between the accumulator's calls: nothing left over at a
window's start, nothing changed outside the accumulator before its end.

* **Stale gradients.** The accumulator clears ``.grad`` (``set_to_none=True``) at every boundary,
  ``discard()`` and load of an empty window, so at a window's first micro-batch a nonzero
  gradient was put there by something else: your own ``loss.backward()`` before the loop, ``.grad``
  left over from evaluation, a micro-batch that raised half-way and was not discarded, another
  accumulator's backward through these parameters (a GAN's generator step through a
  discriminator that still requires grad). It would be added into the window silently (2x on the
  first window). :meth:`WindowGrads.check_clean` refuses that micro-batch before its backward; a
  zero gradient (``zero_grad(set_to_none=False)``) passes. Cost: one pass reading each ``.grad``
  (no kernel); a read of the values (a kernel and a host read) only for a gradient that is
  present, which after the accumulator's own boundary none is.
* **Nothing changes between the accumulator's calls.** Autograd adds into ``.grad`` in place
  during a backward pass, and only then: each in-place addition advances the tensor's version
  counter. How many additions a pass makes is the model's business (a parameter used in k
  reentrant checkpoint segments takes k per pass, the depth may change with the input; the
  gradients of parameters combined by ``torch.stack`` are views of one buffer and share one
  counter), so no bound on the count is kept. Instead, after every micro-batch the accumulator
  fed (:meth:`WindowGrads.note`) the versions of the window's gradient tensors are read, and
  before the next one (:meth:`WindowGrads.check`) they must be the same: whatever advanced them
  in between ran outside the accumulator (``grad.mul_``, ``zero_grad(set_to_none=False)``,
  clipping, another backward). Before the window's last micro-batch (or ``flush()``) each
  parameter's ``.grad`` must also still be the tensor recorded: cleared or replaced raises. Both
  raise before that micro-batch's backward, naming the parameter. A micro-batch is one call of
  the accumulator: one ``backward``, a whole ``micro_batch`` block, a whole ``backward_cached`` or
  ``backward_pipeline`` call (what runs inside it, the block's code between its ``mb.backward``
  calls included, is not watched). Nothing is left on the parameters (no hook): the cost is a
  read of one attribute per gradient tensor after each micro-batch and before the next (about 8
  us for GPT-2 small's 148 tensors), no kernel, no host sync, no Python call inside a backward.
* **What it cannot see.** An edit through ``p.grad.data`` (``p.grad.data.mul_(2)``) changes the
  values without advancing the version counter; it is not seen. Nor is a gradient held outside
  ``.grad`` (``accum_dtype`` buffers; FSDP2's unsharded sums under ``sync="window"``): it is
  ``None`` when recorded. Under ``sync="micro_batch"`` (or ``sync="local"`` under a process group
  of several ranks, where a DDP model not given as ``model=`` reduces every backward itself) a
  reduction may give ``.grad`` another tensor in a backward: an edit in place between two
  micro-batches is refused the same, but before the last only a cleared gradient is.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

__all__ = ["WindowGrads"]

_VERSION = operator.attrgetter("_version")
_GRAD = operator.attrgetter("grad")

# Micro-batches fed by every accumulator of this process: one that moved between two of an
# accumulator's calls names another accumulator's backward as a likely cause of an edit.
_FED = [0]


def _storage(g: torch.Tensor) -> int:
    """Where ``g``'s values live (gradients of one buffer share it), or its id."""
    try:
        return int(getattr(g, "_local_tensor", g).untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return id(g)


class WindowGrads:
    """The gradient checks of one accumulator, between its calls.

    Args:
        params: the optimizer's parameters, in order.
        model: the accumulator's ``model=`` (names the parameters in messages), or None.
        exact: no cross-rank reduction gives ``.grad`` another tensor before the window's last
            micro-batch (``torch/_guards.py``'s ``exact_grads``).
    """

    def __init__(self, params: Sequence[torch.Tensor], model: Any, exact: bool) -> None:
        self._params = params
        self._model = model
        self.exact = exact
        self._grads: list[torch.Tensor] | None = None  # the window's gradient tensors (None: none yet)
        self._index: list[int] = []  # their parameters' indices
        self._missing: list[int] = []  # parameters without a gradient at the last note
        self._versions: list[int] = []  # the versions of _grads after the last micro-batch
        self._fed = _FED[0]  # _FED[0] after this accumulator's last micro-batch or boundary

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
                    "before the loop, .grad left over from evaluation, a micro-batch that raised "
                    "half-way, or another accumulator's backward through these parameters, such as "
                    "a GAN's generator step through a discriminator that still requires grad) would "
                    "be added into this window. Call optimizer.zero_grad(set_to_none=True) before the "
                    "loop (acc.discard() after a micro-batch that raised; freeze the other model, "
                    "requires_grad_(False), during the other accumulator's backward); nothing has "
                    f"changed.{self._another()}")

    def note(self) -> None:
        """After a micro-batch the accumulator fed: keep the window's gradient tensors (at its
        first) and their versions."""
        _FED[0] += 1  # self._mark(), inline: a call less per micro-step
        self._fed = _FED[0]
        grads = self._grads
        if grads is None:
            params = self._params
            present = [i for i, p in enumerate(params) if p.grad is not None]
            self._index = present
            self._grads = grads = [params[i].grad for i in present]  # type: ignore[misc]
            self._missing = [i for i, p in enumerate(params) if p.grad is None] \
                if len(present) < len(params) else []
        elif self._missing:
            self._adopt_missing(grads)
        self._versions = list(map(_VERSION, grads))

    def _adopt_missing(self, grads: list[torch.Tensor]) -> None:
        """Parameters that received their first gradient of the window in this micro-batch (an
        expert routed to only now) are watched from here on."""
        params, still = self._params, []
        for i in self._missing:
            g = params[i].grad
            if g is None:
                still.append(i)
            else:
                self._index.append(i)
                grads.append(g)
        self._missing = still

    def forget(self) -> None:
        """The window closed, was dropped or reloaded: nothing recorded."""
        self._grads = None
        self._mark()

    def _mark(self) -> None:
        """This accumulator fed a micro-batch or closed a window: count it, for :meth:`_another`."""
        _FED[0] += 1
        self._fed = _FED[0]

    def check(self, fed: int, steps: int, last: bool | None = None) -> None:
        """Before a later micro-batch of the window (``fed`` of ``steps`` in it): no gradient
        changed since the last one; before the last (``last``: by default when ``fed + 1 >=
        steps``; True for a flush) each is still the tensor recorded.

        Raises:
            RuntimeError: naming the parameter (or, when every gradient changed, the likely
                calls) and the fix; nothing has changed.
        """
        grads = self._grads
        if grads is None:
            return
        if grads:
            params = self._params
            if params[self._index[0]].grad is None and all(params[i].grad is None for i in self._index):
                self._refuse_all("cleared", fed, steps)  # zero_grad(): said as such
            if list(map(_VERSION, grads)) != self._versions:
                self._refuse_changed(grads, fed, steps)
        if last or (last is None and fed + 1 >= steps):
            self._check_same(grads, fed, steps)

    def _check_same(self, grads: list[torch.Tensor], fed: int, steps: int) -> None:
        """Each recorded gradient is still its parameter's ``.grad`` (not exact: not cleared)."""
        params = self._params
        for i, g in zip(self._index, grads, strict=True):
            now = params[i].grad
            if now is g or (now is not None and not self.exact):
                continue
            self._refuse_one(i, "cleared (set to None)" if now is None else "replaced by another tensor",
                             fed, steps)

    def _refuse_changed(self, grads: list[torch.Tensor], fed: int, steps: int) -> NoReturn:
        """Raise for the gradients whose version moved since the last micro-batch."""
        changed = [j for j, (g, v) in enumerate(zip(grads, self._versions, strict=True)) if g._version != v]
        if len(changed) == len(grads) > 1:
            self._refuse_all("changed in place", fed, steps)
        storage = _storage(grads[changed[0]])
        views = [self._name(self._index[j]) for j in changed[1:] if _storage(grads[j]) == storage]
        what = "changed in place" if not views else (
            f"changed in place (or one of {', '.join(views)}: their gradients are views of one buffer, "
            "as torch.stack or torch.cat of parameters leaves them, and share one version counter)")
        self._refuse_one(self._index[changed[0]], what, fed, steps)

    def _another(self) -> str:
        """A sentence naming another accumulator's backward, when one ran since the last note."""
        if _FED[0] == self._fed:
            return ""
        return (" Another accumulator fed a micro-batch since this one's last: its backward may "
                "have added into these gradients (a GAN's generator step through a discriminator "
                "that still requires grad: freeze it, requires_grad_(False), during that backward, "
                "or detach what the other loss reads from this model).")

    def _refuse_all(self, what: str, fed: int, steps: int) -> NoReturn:
        raise RuntimeError(
            f"the window's gradients were {what} outside the accumulator after micro-batch {fed} "
            f"of {steps}: optimizer.zero_grad() or model.zero_grad() (or clipping the gradients) "
            "inside an open window, a backward pass of your own, or one of the accumulator's "
            "that raised half-way (an exception in your code, Ctrl-C).{} The accumulator clears, "
            "clips and steps once per window, when acc.backward() completes it: remove those "
            "calls, then acc.discard() this window (its gradients are lost)".format(self._another()))

    def _refuse_one(self, i: int, what: str, fed: int, steps: int) -> NoReturn:
        raise RuntimeError(
            f"the gradient of {self._name(i)} was {what} outside the accumulator during this "
            f"window ({fed} of {steps} micro-batches fed): zero_grad(), clipping or scaling "
            "gradients yourself, setting .grad, or a backward pass of your own, inside an open "
            "window, or one of the accumulator's that raised half-way (an exception in your code, "
            "Ctrl-C).{} The accumulator clips and steps once per window, when acc.backward() "
            "completes it: remove that code, then acc.discard() this window (its gradients are "
            "lost)".format(self._another()))

    def _name(self, i: int) -> str:
        """``parameter 'fc.bias'`` when ``model=`` names it, else its index in the optimizer."""
        p = self._params[i]
        if self._model is not None:
            for name, q in self._model.named_parameters():
                if q is p:
                    return f"parameter {name!r}"
        return f"the optimizer's parameter {i} (shape {tuple(p.shape)})"
