"""The MindSpore :class:`Accumulator`: a ``jit_class`` that turns N micro-batch gradients into one
exact optimizer update, called inside ``@ms.jit`` (or eagerly) like the tutorial's class.

How the work splits between the pure core and the graph: a compiled graph cannot run Python on
every micro-step, so everything that Python decides runs once, on the host, with the core
(validation of ``steps`` and ``clip_norm``, the schedule's table of window sizes, the checkpoint
record and its checks, the window record behind :attr:`Accumulator.window`), and the per-step
state lives in ``Parameter`` objects that the graph updates in place (the gradient buffer, the
micro-step, the item total, the window size, the optimizer-step count). The graph applies the
core's window rules as tensor arithmetic: MindSpore hands the accumulator each micro-batch's raw
gradient (there is no loss to pre-scale), so the core's two factors are applied together at the
boundary: mean weighting ``loss_factor x grad_factor = 1/N x N/r = 1/r``; item weighting
``n_i`` per micro-batch (the core's ``loss_factor``) and ``1/sum(n_i)`` at the boundary.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops

from gradaccum.core import Weighting, Window, as_schedule, check_optional_positive_float
from gradaccum.core.validate import check_nonneg_int
from gradaccum.mindspore import buffers
from gradaccum.mindspore import state as _state
from gradaccum.mindspore.validate import check_call, check_parts

__all__ = ["Accumulator"]

_instance_ids = itertools.count()


def _counter(tag: str, name: str, value: int, dtype: Any = ms.int32) -> Parameter:
    return Parameter(Tensor(value, dtype), f"{tag}.{name}", requires_grad=False)


@ms.jit_class
class Accumulator:
    """Accumulate N micro-batch gradients in one buffer and apply them as one exact update.

    Call it with each micro-batch's gradients, inside ``@ms.jit`` or eagerly. At each window
    boundary, in this order: normalize, clip the window gradient's global L2 norm to
    ``clip_norm``, optimizer step; the next window's first micro-batch then overwrites the
    buffer in place (no zeros copy, no zeroing pass). Between boundaries the parameters are
    unchanged. The buffer is the only parameter-sized state (the tutorial's class keeps two).

    Normalization: with ``weighting="mean"`` the window's gradient is the mean of its
    micro-batch gradients (a flushed window of r micro-batches is the mean over r); with
    ``weighting="items"`` every call passes ``n_items`` and the window's gradient is the gradient
    of ``sum(n_i * loss_i) / sum(n_i)``.

    Args:
        optimizer: the ``mindspore.nn.Optimizer`` to step once per window; the gradients passed
            in follow its ``parameters`` order (``model.trainable_params()``).
        steps: micro-batches per window: an int, a mapping ``{optimizer_step: N}``, or a
            :class:`gradaccum.Schedule` (a callable one only with ``by="epoch"``).
        clip_norm: clip the window gradient's global L2 norm to this value (``None``: no clip).
        weighting: ``"mean"`` (default) or ``"items"``. Fixed per accumulator, so that a graph
            that mixes the two fails when it compiles rather than at run time.

    Raises:
        TypeError, ValueError: an argument of the wrong type or value (the message names it).

    Example:
        >>> import mindspore as ms
        >>> net = ms.nn.Dense(3, 1)
        >>> acc = Accumulator(ms.nn.SGD(net.trainable_params(), 0.1), steps=2)
        >>> grad_fn = ms.value_and_grad(lambda x: net(x).mean(), None, net.trainable_params())
        >>> x = ms.ops.ones((4, 3), ms.float32)
        >>> [bool(acc(grad_fn(x)[1])) for _ in range(4)]
        [False, True, False, True]
        >>> acc.optimizer_steps, acc.micro_step
        (2, 0)
    """

    def __init__(self, optimizer: Any, steps: Any, clip_norm: float | None = None, *,
                 weighting: Weighting = "mean") -> None:
        schedule = as_schedule(steps)
        self.clip_norm = check_optional_positive_float("clip_norm", clip_norm)
        check_parts(optimizer, weighting, schedule)
        self.optimizer = optimizer
        self.schedule = schedule
        self.weighting = weighting
        self.epoch = 0
        self._by_epoch = schedule.by == "epoch"
        table = schedule.table()
        # A table of one entry is a constant: the graph then never looks N up.
        self._table: tuple[Tensor, Tensor] | None = None
        if not self._by_epoch and table is not None and len(table[0]) > 1:
            self._table = (Tensor(np.array(table[0], np.int64)), Tensor(np.array(table[1], np.int32)))
        tag = f"gradaccum{next(_instance_ids)}"
        self._grads = optimizer.parameters.clone(prefix=tag, init="zeros")
        for buf in self._grads:
            buf.requires_grad = False
        first = schedule(0)
        self._size = _counter(tag, "size", first)
        self._next_size = _counter(tag, "next_size", first)
        self._micro_step = _counter(tag, "micro_step", 0)
        self._optimizer_steps = _counter(tag, "optimizer_steps", 0, ms.int64)
        self._items = _counter(tag, "items", 0, ms.int64)
        self._grad_norm = Parameter(Tensor(0.0, ms.float32), f"{tag}.grad_norm", requires_grad=False)
        self._map = ops.HyperMap()

    # ------------------------------------------------------------------ graph methods
    def __call__(self, grads: Sequence[Tensor], n_items: Any = None) -> Tensor:
        """Add one micro-batch's gradients; step the optimizer when the window is complete.

        Args:
            grads: the gradients of the micro-batch's *mean* loss (``value_and_grad`` output),
                one per optimizer parameter, in order. Do not divide the loss by N: the
                accumulator normalizes.
            n_items: the micro-batch's number of items (``weighting="items"`` only, then on
                every call): an integer Tensor (its value is not read, so that the graph never
                waits for it) or a Python int >= 1 (checked; each new int value compiles anew
                inside ``@ms.jit``).

        Returns:
            A bool Tensor: True when this call completed the window and the optimizer stepped.

        Raises:
            TypeError, ValueError: a bad ``n_items`` or ``grads``; inside ``@ms.jit`` when the
                graph compiles, before anything changes.
        """
        check_call(len(self._grads), self.weighting, grads, n_items)
        if n_items is None:
            added = self._add(grads)
        else:
            count = Tensor(n_items, ms.int64) if isinstance(n_items, int) else (
                n_items.reshape(()).astype(ms.int64))
            added = self._add_weighted(grads, count)
            ops.assign_add(self._items, count)
        ops.assign_add(self._micro_step, Tensor(1, ms.int32))
        stepped = ops.depend(self._micro_step >= self._size, added)
        if stepped:
            # Assigned, not just called: inside a graph branch, MindSpore drops a call whose
            # result goes nowhere (a method returning None), side effects included.
            stepped = self._apply()
        return stepped

    def flush(self) -> Tensor:
        """Apply a partial window now (end of data), as the mean over the micro-batches it holds.

        Returns:
            A bool Tensor: True when the optimizer stepped, False when nothing was pending.
        """
        stepped = self._micro_step > 0
        if stepped:
            stepped = self._apply()
        return stepped

    def discard(self) -> Tensor:
        """Drop the partial window: the next micro-batch starts a new one."""
        ops.assign(self._micro_step, Tensor(0, ms.int32))
        ops.assign(self._items, Tensor(0, ms.int64))
        return self._micro_step == 0

    def _add(self, grads: Sequence[Tensor]) -> Any:
        # Both branches return their assigns' results: a graph branch whose result goes nowhere
        # is dropped, side effects included.
        if self._micro_step == 0:
            done = self._map(buffers.set_, self._grads, grads)
        else:
            done = self._map(buffers.add_, self._grads, grads)
        return done

    def _add_weighted(self, grads: Sequence[Tensor], count: Tensor) -> Any:
        if self._micro_step == 0:
            done = self._map(ops.partial(buffers.set_weighted_, count), self._grads, grads)
        else:
            done = self._map(ops.partial(buffers.add_weighted_, count), self._grads, grads)
        return done

    def _apply(self) -> Tensor:
        if self.weighting == "items":
            factor = 1.0 / self._items.astype(ms.float32)
        else:
            factor = 1.0 / self._micro_step.astype(ms.float32)
        if self.clip_norm is not None:
            # The norm of the normalized gradient is factor x the buffer's; one scaling pass
            # applies both, with the coefficient torch's clip_grad_norm_ uses.
            norm = ops.sqrt(ops.addn(self._map(buffers.square_sum, self._grads))) * factor
            ops.assign(self._grad_norm, norm)
            factor = factor * ops.minimum(self.clip_norm / (norm + 1e-6), 1.0)
        self._map(ops.partial(buffers.scale_, factor), self._grads)
        self.optimizer(self._grads)
        ops.assign_add(self._optimizer_steps, Tensor(1, ms.int64))
        ops.assign(self._micro_step, Tensor(0, ms.int32))
        ops.assign(self._items, Tensor(0, ms.int64))
        self._reopen()
        return self._micro_step == 0

    def _reopen(self) -> None:
        # The schedule is read only here, when a window opens, as in the core.
        if self._by_epoch:
            ops.assign(self._size, self._next_size)
        elif self._table is not None:
            starts, sizes = self._table
            index = (starts <= self._optimizer_steps).astype(ms.int32).sum() - 1
            ops.assign(self._size, sizes[index])

    # ------------------------------------------------------------------ host methods
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
        self._next_size.set_data(Tensor(size, ms.int32))
        if self.micro_step == 0:
            self._size.set_data(Tensor(size, ms.int32))

    def state_dict(self) -> dict[str, Any]:
        """All a bit-exact resume in the middle of a window needs (NumPy copies, picklable).

        Returns:
            Counters, the window record (size, micro-step, weighting, item total), the schedule's
            description, a parameter signature and copies of the partial gradients. Save it
            beside the model's and the optimizer's checkpoints.
        """
        return _state.pack(self.window, self.schedule.describe(), self.optimizer_steps,
                           self.epoch, self._grads)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`, partial gradients included.

        Raises:
            TypeError, ValueError: not a state, or one from an accumulator with other ``steps``,
                weighting or parameters; nothing is changed then.
        """
        window = _state.check(state, self.schedule.describe(), self.weighting, self._grads)
        _state.restore(state, self._grads)
        self.epoch = state["epoch"]
        self._size.set_data(Tensor(window.size, ms.int32))
        size = self.schedule(self.epoch) if self._by_epoch else window.size
        self._next_size.set_data(Tensor(size, ms.int32))
        self._micro_step.set_data(Tensor(window.micro_step, ms.int32))
        self._items.set_data(Tensor(int(window.items), ms.int64))
        self._optimizer_steps.set_data(Tensor(state["optimizer_steps"], ms.int64))

    def __repr__(self) -> str:
        return (f"Accumulator(steps={self.schedule.describe()!r}, weighting={self.weighting!r}, "
                f"micro_step={self.micro_step}, optimizer_steps={self.optimizer_steps})")
