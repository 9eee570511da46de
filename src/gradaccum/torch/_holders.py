"""Which accumulators hold which parameters' gradients: no window is fed on top of another's.

Accumulators over the same parameters share their ``.grad``. Two cases would mix windows:

* **Two live accumulators.** One opens a window while another holds a partial window over any of
  its parameters (the obvious way to give two loss terms two normalizers, one accumulator each):
  the first one's step would apply the other's gradients and then zero them. The window's *first*
  micro-batch is refused, before its backward runs, with a ``RuntimeError`` naming both: nothing
  has changed, so ``flush()`` or ``discard()`` of the holder lets the other one proceed. Checking
  the first micro-batch suffices: two windows overlap only if one opened while the other was open.
* **A dropped accumulator.** An accumulator garbage-collected with a partial window (built per
  epoch and never flushed) leaves its gradients in ``.grad``, and the next accumulator would apply
  them silently. The dropped one marks its parameters; the next accumulator over any of them, at
  its first micro-batch, **warns once and discards** those gradients (as ``drop_last`` would),
  naming ``flush()``. A warning, not an error: the run goes on correct, without the lost
  micro-batches, exactly as if they had been discarded; ``load_state_dict`` clears the mark (it
  restores the gradients itself).

``discard()`` of either of two accumulators that share parameters drops the shared window: an
accumulator whose partial window lost its gradients that way is discarded too, with a warning.

Cost: at a window's first micro-batch, two truth tests of module-level sets (one accumulator, no
dropped one: nothing more); nothing on other micro-batches.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Holders"]

# The entry of every live accumulator (held weakly: an entry lives as long as its accumulator).
_LIVE: weakref.WeakSet[Holders] = weakref.WeakSet()
# parameter -> what the accumulator dropped with a partial window over it held
_ORPHANED: WeakIdKeyDictionary = WeakIdKeyDictionary()


class Holders:
    """One accumulator's entry in the module's registry.

    It reads its accumulator's public ``micro_step`` (how many micro-batches its window holds) and
    calls its public ``discard()``; the entries of other accumulators are read the same way.

    Args:
        owner: the accumulator (held weakly).
        params: its optimizer's parameters.
    """

    def __init__(self, owner: Any, params: Sequence[torch.Tensor]) -> None:
        self.ids = frozenset(id(p) for p in params)
        self._params = list(params)
        self._owner = weakref.ref(owner)
        _LIVE.add(self)

    @property
    def owner(self) -> Any:
        """The accumulator, or None once it is gone."""
        return self._owner()

    def open_steps(self) -> int:
        """Micro-batches the accumulator's window holds (0 once it is gone)."""
        owner = self._owner()
        return 0 if owner is None else int(owner.micro_step)

    def check_first(self) -> None:
        """Before a window's first micro-batch: refuse if another live accumulator holds a partial
        window over these parameters; discard, with a warning, what a dropped one left.

        Raises:
            RuntimeError: naming both accumulators and what to do; nothing has changed.
        """
        if len(_LIVE) > 1:
            self.refuse_overlap()
        if _ORPHANED:
            self._discard_orphans()

    def refuse_overlap(self, doing: str = "open a window", effect: str = "apply and then zero") -> None:
        """Raise if another live accumulator holds a partial window over these parameters
        (``doing``: what the owner was about to do; ``effect``: what that would do to it).

        Raises:
            RuntimeError: naming both accumulators and what to do.
        """
        if self._holder() is None:
            return
        # An accumulator dropped inside a reference cycle lives until the collector runs: collect
        # once, on a conflict only, before calling it one (it then leaves an orphaned window).
        gc.collect()
        found = self._holder()
        if found is not None:
            owner, (other, held) = self._owner(), found
            raise RuntimeError(
                f"{owner!r} (id {id(owner):#x}) cannot {doing}: {other!r} (id {id(other):#x}) holds a "
                f"partial window of {held} micro-batch(es) over the same parameters, in the same "
                f".grad, which this one would {effect}. Nothing has changed: flush() or "
                "discard() the other one first, or use one accumulator per set of parameters (for "
                "loss terms of different normalizers: acc.micro_batch() and mb.term(loss, n_items, "
                "total=T))")

    def discard_others(self) -> None:
        """Before the owner sets the shared gradients to None: discard every other accumulator
        whose partial window lives in them (its gradients are gone), with a warning."""
        if len(_LIVE) < 2:
            return
        owner = self._owner()
        for entry in list(_LIVE):
            other = entry.owner
            if entry is self or other is None or not self.ids & entry.ids or not entry.open_steps():
                continue
            warnings.warn(f"discard() of {owner!r} also discards {other!r}: its partial window lived in "
                          "the same .grad", stacklevel=4)
            other.discard()

    def orphan(self, micro_step: int, steps: int) -> None:
        """Mark the parameters of an accumulator dropped with a partial window (from its
        ``__del__``)."""
        for p in self._params:
            _ORPHANED[p] = (micro_step, steps)

    def adopt(self) -> None:
        """Forget the marks on these parameters (``load_state_dict`` sets the gradients itself)."""
        for p in self._params:
            if p in _ORPHANED:
                del _ORPHANED[p]

    def _discard_orphans(self) -> None:
        marks = [(p, _ORPHANED[p]) for p in self._params if p in _ORPHANED]
        if not marks:
            return
        micro_step, steps = marks[0][1]
        left = [p for p, _ in marks if p.grad is not None]
        for p, _ in marks:
            p.grad = None
            del _ORPHANED[p]
        if not left:  # the user cleared them already
            return
        warnings.warn(
            f"an Accumulator dropped with a partial window ({micro_step} of {steps} micro-batches) left "
            f"its gradients in .grad of {len(left)} of these parameters: discarded, not applied. "
            "Call flush() (or discard()) before dropping an accumulator, e.g. at the end of each "
            "epoch, or keep one accumulator for the whole run", stacklevel=5)

    def _holder(self) -> tuple[Any, int] | None:
        """Another live accumulator with a partial window over these parameters, and its count."""
        for entry in list(_LIVE):
            other = entry.owner
            if entry is self or other is None or not self.ids & entry.ids:
                continue
            held = entry.open_steps()
            if held:
                return other, held
        return None
