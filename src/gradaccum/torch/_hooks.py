"""Callbacks the accumulator runs at window events (a boundary, a discard): one :class:`HookList`
per event, filled by ``register_boundary_hook`` and ``register_discard_hook``; and the hooks the
accumulator's parts put on its optimizer (:func:`hook_optimizer`, :func:`retire`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["Feed", "HookList", "hook_optimizer", "retire"]

# Optimizer hooks of dropped accumulators, taken off when the next hook is put on: an accumulator
# can be collected while the optimizer iterates over its hooks (a collection triggered inside
# one), where removing a hook would change the dict being iterated.
_RETIRED: list[RemovableHandle] = []


def hook_optimizer(optimizer: Any, register: Callable[[torch.optim.Optimizer], RemovableHandle]
                   ) -> RemovableHandle:
    """``register(inner)`` on the optimizer that ``optimizer`` steps (a wrapper's, such as
    Accelerate's ``AcceleratedOptimizer``: the one it wraps), after taking off the retired hooks.

    Returns:
        The handle ``register`` returned; :func:`retire` it when its accumulator is gone.
    """
    inner: Any = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    while _RETIRED:
        _RETIRED.pop().remove()
    return register(inner)


def retire(handle: RemovableHandle) -> None:
    """Take ``handle``'s hook off its optimizer when the next one is put on (safe to call while
    the optimizer runs its hooks)."""
    _RETIRED.append(handle)


class Feed(NamedTuple):
    """What a feed hook (``Accumulator.register_feed_hook``) is told before a backward.

    Attributes:
        micro_step: the window's micro-batches fed before this one (its index in the window).
        n_items: the count given (None: mean weighting).
        reduction: ``"mean"`` or ``"sum"``.
        seed: the gradient the backward starts from, the micro-batch's weight in the window's
            accumulated gradient before the boundary's normalization (None: 1); an active
            GradScaler's scale multiplies it in the backward.
        pipeline: for a ``backward_pipeline`` call, its :class:`PipelineFeed` (None otherwise).
    """

    micro_step: int
    n_items: Any
    reduction: str
    seed: Any
    pipeline: Any = None


class PipelineFeed(NamedTuple):
    """What a feed hook is told of a ``backward_pipeline`` call, twice: before anything changes
    (``items`` None: refuse here what is not supported, on every rank alike) and right before the
    schedule's ``step()``, once the ranks agreed.

    Attributes:
        stages: this rank's pipeline stages; n_microbatches: the schedule's.
        steps: the accumulator's window size (a mean window's boundary multiplies by
            ``steps / micro_steps``).
        items: the window is item-weighted on the last stage (the boundary divides by its item
            total and multiplies by ``scale``); None in the first call.
        scale: the provisional total ``P`` the item-weighted losses were divided by (None: 1).
        world_size: the data-parallel replicas of a stage.
    """

    stages: Any
    n_microbatches: int
    steps: int
    items: Any = None
    scale: Any = None
    world_size: int = 1


class HookList:
    """An ordered set of ``hook(accumulator)`` callbacks with removable handles.

    Example:
        >>> seen = []
        >>> hooks = HookList()
        >>> handle = hooks.register(seen.append)
        >>> hooks("acc"); handle.remove(); hooks("again")
        >>> seen
        ['acc']
    """

    def __init__(self) -> None:
        # OrderedDict: RemovableHandle keeps a weak reference to it, which a plain dict refuses.
        self._hooks: OrderedDict[int, Callable[[Any], None]] = OrderedDict()
        # The hooks, read-only: truthy when any is registered, tested on a hot path without a call.
        self.registered: Mapping[int, Callable[[Any], None]] = self._hooks

    def register(self, hook: Callable[[Any], None]) -> RemovableHandle:
        """Add ``hook``; the handle's ``remove()`` takes it out again."""
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def __call__(self, acc: Any) -> None:
        """Run every hook, in registration order (a copy: hooks may remove themselves)."""
        for hook in list(self._hooks.values()):
            hook(acc)
