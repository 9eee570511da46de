"""What a ``backward_cached`` call writes into ``.grad``, and what it can put back for free.

The call adds its batch's gradient into the window's ``.grad`` in place, as ``backward`` does:
no second, parameter-sized set of gradients is held. Two things keep it all-or-nothing wherever
that costs nothing:

* :class:`LossGrads`: the gradient ``loss_fn``'s own parameters (a temperature, a head applied in
  the loss) get from the loss's backward is kept out of ``.grad`` until the second pass's last
  chunk (its size: those parameters'); their gradients before the call are held aside
  (references, no copy). An exception before then (in ``encode``, a check, a chunk's forward)
  puts them back.
* :class:`GradsBefore`: which parameters had a gradient before the call, and each one's tensor
  and version. After an exception, a gradient that did not exist is set back to None (on a
  window's first micro-batch: all of them, so nothing is left), and the others are found intact
  or not: when one was added into, the window is partly accumulated (the accumulator then
  refuses to go on until ``discard()``).

:func:`put_back` does both after an exception, and under FSDP2 drops the unsharded gradients it
holds for its next reduction when they are the call's own. A window left partly accumulated is
named by :func:`partial_cause` (what the call raised), and :func:`refuse_partial` is the
accumulator's refusal to feed, flush or save it until ``discard()``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from gradaccum.torch._grads import graph_nodes, version

__all__ = ["GradsBefore", "LossGrads", "loss_params", "partial_cause", "put_back", "refuse_partial"]


def loss_params(loss: torch.Tensor, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors that require grad and that ``loss``'s graph reaches, other than ``leaves``:
    the parameters ``loss_fn`` used (its graph ends at the representations' leaves, so the walk
    covers the loss's own operations only)."""
    mine = {id(t) for t in leaves}
    leaf_nodes = (getattr(node, "variable", None) for node in graph_nodes([loss.grad_fn]))
    return [v for v in leaf_nodes if isinstance(v, torch.Tensor) and id(v) not in mine]


class LossGrads:
    """The loss's backward into ``loss_fn``'s parameters, held out of ``.grad`` until :meth:`add`.

    Args:
        params: the parameters the loss's graph reaches (:func:`loss_params`); made before the
            loss's backward, which then writes their fresh gradient (:meth:`take` collects it).
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.saved = [p.grad for p in self.params]
        self.fresh: list[torch.Tensor | None] = []
        self.added = False
        for p in self.params:
            p.grad = None

    def take(self) -> None:
        """After the loss's backward: keep its gradients, put the earlier ones back."""
        self.fresh = [p.grad for p in self.params]
        self.undo()

    def add(self) -> None:
        """Before the second pass's last backward: add the loss's gradients into ``.grad`` (under
        DDP that backward then hands them to the reduction)."""
        self.added = True
        for p, g in zip(self.params, self.fresh, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        self.fresh = []

    def undo(self) -> None:
        """Put the gradients held before the call back (before :meth:`add` only)."""
        if not self.added:
            for p, g in zip(self.params, self.saved, strict=True):
                p.grad = g


class GradsBefore:
    """Each parameter's gradient before the call: None, or its tensor (weakly) and version.

    Args:
        params: the optimizer's parameters.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = params
        self.before = [None if p.grad is None else (weakref.ref(p.grad), version(p.grad)) for p in params]

    def restore(self) -> bool:
        """Set every gradient that did not exist before back to None; return True when each one
        that did is the same tensor with the same values (the call added nothing into it)."""
        intact = True
        for p, held in zip(self.params, self.before, strict=True):
            if held is None:
                p.grad = None
                continue
            ref, was = held
            g = p.grad
            intact = intact and g is not None and ref() is g and version(g) == was
        return intact


def put_back(before: GradsBefore, sync: Any, empty: bool, began: bool) -> bool:
    """After an exception in a call: set back the gradients that did not exist before it; under
    FSDP2, once the second pass began, drop the unsharded gradients FSDP2 holds for its next
    reduction when they are the call's own (``sync="micro_batch"``: the chunks before the last are
    paused; ``sync="window"`` on a window's first micro-batch, ``empty``).

    Returns:
        True when nothing the window held before the call was changed.
    """
    intact = before.restore()
    drop = getattr(sync, "drop_pending", None)
    if began and drop is not None:
        if not empty and sync.mode == "window":
            return False  # FSDP2 holds the window's own unsharded gradients among its pending ones
        drop()
    return intact


def partial_cause(error: BaseException) -> str:
    """What a ``backward_cached`` call that left the window partly accumulated raised, in short."""
    text = str(error)
    return f"{type(error).__name__}: {text if len(text) <= 200 else text[:197] + '...'}"


def refuse_partial(cause: str | None, micro_step: int) -> None:
    """Raise if a ``backward_cached`` call left the window partly accumulated (``cause``: what it
    raised; None: the window is whole).

    Raises:
        RuntimeError: naming ``discard()``, the one way on.
    """
    if cause is not None:
        raise RuntimeError(
            f"this window is partly accumulated: a backward_cached call raised ({cause}) after its "
            f"second pass had added part of its batch's gradient into the gradients of the window's "
            f"{micro_step} earlier micro-batch(es). Call acc.discard() to drop the window (its "
            "gradients are lost); then feed the next batch")
