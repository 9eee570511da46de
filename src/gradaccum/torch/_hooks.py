"""Callbacks the accumulator runs at window events (a boundary, a discard): one :class:`HookList`
per event, filled by ``register_boundary_hook`` and ``register_discard_hook``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch.utils.hooks import RemovableHandle

__all__ = ["HookList"]


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

    def register(self, hook: Callable[[Any], None]) -> RemovableHandle:
        """Add ``hook``; the handle's ``remove()`` takes it out again."""
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def __call__(self, acc: Any) -> None:
        """Run every hook, in registration order (a copy: hooks may remove themselves)."""
        for hook in list(self._hooks.values()):
            hook(acc)
