"""The host side of the MindSpore :class:`~gradaccum.mindspore.Accumulator`: reads of its graph
state, ``set_epoch`` and checkpoints, outside any compiled graph.

The accumulator's per-step state lives in ``Parameter`` objects that its graph updates in place;
this mixin reads them back as Python numbers and writes them between graph runs. Writes go
through an eager ``ops.assign``: in MindSpore 2.10, ``Parameter.set_data`` after a graph has run
gives the Parameter new storage that the compiled graph never sees (the graph keeps updating the
old one), so a resume or an epoch's new N would silently not take effect.
"""

from __future__ import annotations

from typing import Any

from mindspore import Parameter, Tensor, ops

import gradaccum.mindspore.state as _state
from gradaccum.core import Schedule, Weighting, Window
from gradaccum.core.validate import check_nonneg_int

__all__ = ["HostSide", "write"]


def write(param: Parameter, value: Any) -> None:
    """Write ``value`` into ``param`` in place, so that a compiled graph sees it.

    Example:
        >>> import mindspore as ms
        >>> p = ms.Parameter(ms.Tensor(0, ms.int32), "p")
        >>> write(p, 3); int(p.asnumpy())
        3
    """
    ops.assign(param, value if isinstance(value, Tensor) else Tensor(value, param.dtype))


class HostSide:
    """Host-side reads and writes of the accumulator's graph state (a mixin)."""

    schedule: Schedule
    weighting: Weighting
    epoch: int
    clip_norm: float | None
    _by_epoch: bool
    _reduce: Any
    _grads: Any
    _size: Parameter
    _next_size: Parameter
    _micro_step: Parameter
    _optimizer_steps: Parameter
    _items: Parameter
    _grad_norm: Parameter
    _loss_sum: Parameter
    _loss_count: Parameter
    _window_loss: Parameter
    _has_window_loss: Parameter

    @property
    def window(self) -> Window:
        """The current window as the core's record (read from the graph's state)."""
        micro = int(self._micro_step.asnumpy())
        weighting = None if micro == 0 else self.weighting
        items = int(self._items.asnumpy()) if self.weighting == "items" else 0
        return Window(int(self._size.asnumpy()), micro, weighting, items)

    @property
    def micro_step(self) -> int:
        """Micro-batches fed to the current window (0 right after a boundary)."""
        return int(self._micro_step.asnumpy())

    @property
    def steps(self) -> int:
        """Micro-batches that complete the current window (N)."""
        return int(self._size.asnumpy())

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far."""
        return int(self._optimizer_steps.asnumpy())

    @property
    def window_loss(self) -> float | None:
        """The last applied window's loss, weighted like its gradient: the mean of its
        micro-batch losses, or their item-weighted mean under ``weighting="items"``; over every
        rank's micro-batches under data parallel.

        ``None`` before the first boundary, or when a micro-batch of that window was fed
        without ``loss=``.
        """
        if not int(self._has_window_loss.asnumpy()):
            return None
        return float(self._window_loss.asnumpy())

    @property
    def world_size(self) -> int:
        """Ranks the window is reduced over (1 without data parallel)."""
        return 1 if self._reduce is None else int(self._reduce.world)

    @property
    def grad_norm(self) -> float | None:
        """The last window gradient's global L2 norm before clipping (``None`` without clip)."""
        return None if self.clip_norm is None else float(self._grad_norm.asnumpy())

    def set_epoch(self, epoch: int) -> None:
        """Tell an epoch schedule (``Schedule(..., by="epoch")``) that ``epoch`` begins.

        An empty window takes the new N at once; a window carried over keeps its N until its
        boundary. Call it outside the graph, before the epoch's first micro-batch.

        Raises:
            TypeError, ValueError: ``epoch`` is not an integer >= 0.
        """
        self.epoch = check_nonneg_int("epoch", epoch)
        if not self._by_epoch:
            return
        size = self.schedule(self.epoch)
        write(self._next_size, size)
        if self.micro_step == 0:
            write(self._size, size)

    def state_dict(self) -> dict[str, Any]:
        """All a bit-exact resume in the middle of a window needs (NumPy copies, picklable).

        Returns:
            Counters, the window record (size, micro-step, weighting, item total), the window
            loss and the open window's loss sum, the schedule's description, a parameter
            signature and copies of the partial gradients (this rank's, under data parallel).
            Save it beside the model's and the optimizer's checkpoints.
        """
        micro = self.micro_step
        loss_sum = float(self._loss_sum.asnumpy()) if micro > 0 and int(
            self._loss_count.asnumpy()) == micro else None
        return _state.pack(self.window, self.schedule.describe(), (self.optimizer_steps, self.epoch),
                           self._grads, (self.window_loss, loss_sum))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`, partial gradients and window loss included.

        Every field is checked first (types; ``0 <= micro_step < size``; the weighting; counters
        >= 0; the item total against the weighting; the gradients' shapes); then all are written.

        Raises:
            TypeError, ValueError: not a state, a field out of range (the message names its key),
                or a state from an accumulator with other ``steps``, weighting or parameters;
                nothing is changed then.
        """
        saved = _state.check(state, self.schedule, self.weighting, self._grads)
        for buf, grad in zip(self._grads, saved.grads, strict=True):
            write(buf, grad)
        self.epoch = saved.epoch
        window, loss = saved.window, saved.window_loss
        for param, value in ((self._size, window.size), (self._next_size, saved.next_size),
                             (self._micro_step, window.micro_step), (self._items, int(window.items)),
                             (self._optimizer_steps, saved.optimizer_steps),
                             (self._loss_sum, saved.loss_sum or 0.0),
                             (self._loss_count, 0 if saved.loss_sum is None else window.micro_step),
                             (self._window_loss, 0.0 if loss is None else loss),
                             (self._has_window_loss, int(loss is not None))):
            write(param, value)

    def __repr__(self) -> str:
        return (f"Accumulator(steps={self.schedule.describe()!r}, weighting={self.weighting!r}, "
                f"micro_step={self.micro_step}, optimizer_steps={self.optimizer_steps})")
