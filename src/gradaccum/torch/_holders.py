"""Which accumulators hold which parameters: one accumulator may not step another's partial window.

Two accumulators over the same parameters share their ``.grad``: when one steps, it applies the
other's partial window with its own and then zeroes it (the obvious way to give two loss terms
two normalizers, one accumulator each, silently takes two optimizer steps per window). Every
accumulator is kept in a weak set with the ids of its parameters; at a boundary, and only there,
the stepping one looks for another live accumulator that holds a partial window over any of them.
With one accumulator that is one loop over a set of one; nothing runs on a micro-step.

An error, not a warning: no correct program steps gradients another accumulator still holds (they
are consumed and then zeroed), so the run would be wrong from that window on.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Holders"]

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


class Holders:
    """One accumulator's entry in the module's registry.

    Args:
        owner: the accumulator (held weakly by the registry).
        params: its optimizer's parameters.
        open_steps: returns how many micro-batches an accumulator's window holds.
    """

    def __init__(self, owner: Any, params: Sequence[torch.Tensor],
                 open_steps: Callable[[Any], int]) -> None:
        self.ids = frozenset(id(p) for p in params)
        self._open_steps = open_steps
        _LIVE.add(owner)

    def check_boundary(self, owner: Any) -> None:
        """Raise before ``owner`` steps when another accumulator holds a partial window over
        any of its parameters.

        Raises:
            RuntimeError: naming both accumulators and what to do.
        """
        if self._holder(owner) is None:
            return
        # An accumulator dropped inside a reference cycle lives until the collector runs: collect
        # once, on a conflict only, before calling it one.
        gc.collect()
        found = self._holder(owner)
        if found is not None:
            other, held = found
            raise RuntimeError(
                f"{owner!r} (id {id(owner):#x}) would step parameters that {other!r} (id "
                f"{id(other):#x}) holds a partial window over ({held} micro-batch(es)) in the same "
                ".grad: its gradients would be applied now and then zeroed. Use one accumulator "
                "per set of parameters (for loss terms of different normalizers: "
                "acc.micro_batch() and mb.term(loss, n_items, total=T)), or flush() or discard() "
                "the other one first"
            )

    def _holder(self, owner: Any) -> tuple[Any, int] | None:
        """Another live accumulator with a partial window over these parameters, and its count."""
        for other in list(_LIVE):
            entry = getattr(other, "_holders", None)
            if other is owner or not isinstance(entry, Holders) or not self.ids & entry.ids:
                continue
            held = entry._open_steps(other)
            if held:
                return other, held
        return None
