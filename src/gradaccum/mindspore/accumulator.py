"""The MindSpore :class:`Accumulator`: a ``jit_class`` that turns N micro-batch gradients into one
exact optimizer update, called inside ``@ms.jit`` (or eagerly) like the tutorial's class.

How the work splits between the pure core and the graph: a compiled graph cannot run Python on
every micro-step, so everything that Python decides runs once, on the host, with the core
(validation of ``steps`` and ``clip_norm``, the schedule's table of window sizes, the checkpoint
record and its checks, the window record behind :attr:`Accumulator.window`), and the per-step
state lives in ``Parameter`` objects that the graph updates in place (the gradient buffer, the
micro-step, the item total, the loss sum, the window size, the optimizer-step count); the host
reads and writes them through :mod:`gradaccum.mindspore.host`, and under data parallel the
boundary sums them over the ranks (:mod:`gradaccum.mindspore.data_parallel`). The graph applies the
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

import gradaccum.mindspore.buffers as buffers
from gradaccum.core.schedule import as_schedule
from gradaccum.core.validate import check_optional_positive_float
from gradaccum.core.window import Weighting
from gradaccum.mindspore.data_parallel import (
    ITEM_BASE,
    WindowReduce,
    agree_on_length,
    batchnorm_statistics,
    data_parallel_world,
)
from gradaccum.mindspore.host import HostSide
from gradaccum.mindspore.validate import check_call, check_parts

__all__ = ["Accumulator"]

_instance_ids = itertools.count()


def _counter(tag: str, name: str, value: float, dtype: Any = ms.int32) -> Parameter:
    return Parameter(Tensor(value, dtype), f"{tag}.{name}", requires_grad=False)


@ms.jit_class
class Accumulator(HostSide):
    """Accumulate N micro-batch gradients in one buffer and apply them as one exact update.

    Call it with each micro-batch's gradients, inside ``@ms.jit`` or eagerly. At each window
    boundary, in this order: normalize, clip the window gradient's global L2 norm to
    ``clip_norm``, optimizer step; the next window's first micro-batch then overwrites the
    buffer in place (no zeros copy, no zeroing pass). Between boundaries the parameters are
    unchanged. The buffer is the only parameter-sized state (the tutorial's class keeps two).

    Normalization: with ``weighting="mean"`` the window's gradient is the mean of its
    micro-batch gradients (a flushed window of r micro-batches is the mean over r); with
    ``weighting="items"`` every call passes ``n_items`` and the window's gradient is the gradient
    of ``sum(n_i * loss_i) / sum(n_i)``. Pass ``loss=`` too and :attr:`window_loss` reports the
    window's loss, weighted the same way.

    Data parallel (``msrun``, after ``mindspore.communication.init()``): every rank calls the
    accumulator with its own micro-batches, and at the boundary the window's gradient, item
    total and loss are summed over the ranks in one all-reduce, before normalizing and clipping;
    the micro-steps in between communicate nothing. Every rank must feed the same number of
    micro-batches per window and call :meth:`flush` and :meth:`discard` at the same points;
    :meth:`flush` raises on every rank when their partial windows differ in length. Plain
    BatchNorm keeps running statistics per rank; ``average_batchnorm=model`` replaces them by
    their mean over the ranks at each boundary, in the same all-reduce.

    Args:
        optimizer: the ``mindspore.nn.Optimizer`` to step once per window; the gradients passed
            in follow its ``parameters`` order (``model.trainable_params()``).
        steps: micro-batches per window: an int, a mapping ``{optimizer_step: N}``, or a
            :class:`gradaccum.Schedule` (a callable one only with ``by="epoch"``).
        clip_norm: clip the window gradient's global L2 norm to this value (``None``: no clip).
        weighting: ``"mean"`` (default) or ``"items"``. Fixed per accumulator, so that a graph
            that mixes the two fails when it compiles rather than at run time.
        data_parallel: ``None`` (default): reduce over the ranks when
            ``mindspore.communication.init()`` has run with more than one; ``True``: the same,
            and raise if it has not run; ``False``: never (you reduce the gradients yourself).
        average_batchnorm: a model (``mindspore.nn.Cell``) whose BatchNorm running statistics
            (``moving_mean``, ``moving_variance``) are averaged over the ranks at each boundary,
            so that every rank evaluates with the same ones; ``None`` (default): each rank keeps
            its own. Ignored without data parallel.

    Attributes:
        optimizer: the optimizer stepped once per window.
        schedule: the :class:`gradaccum.Schedule` that ``steps`` became.
        clip_norm: the clipping threshold given (``None``: no clipping).
        weighting: ``"mean"`` or ``"items"``, as given.
        epoch: the epoch last given to ``set_epoch`` (0 before).

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
        >>> loss, grads = grad_fn(x)
        >>> bool(acc(grads, loss=loss)), bool(acc(grads, loss=loss))
        (False, True)
        >>> round(acc.window_loss, 5) == round(float(loss), 5)
        True
    """

    def __init__(self, optimizer: Any, steps: Any, clip_norm: float | None = None, *,
                 weighting: Weighting = "mean", data_parallel: bool | None = None,
                 average_batchnorm: Any = None) -> None:
        schedule = as_schedule(steps)
        self.clip_norm = check_optional_positive_float("clip_norm", clip_norm)
        check_parts(optimizer, weighting, schedule)
        world = data_parallel_world(data_parallel)
        stats = () if average_batchnorm is None else batchnorm_statistics(average_batchnorm)
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
        self._reduce = WindowReduce(self._grads, world, stats) if world > 1 else None
        first = schedule(0)
        self._size = _counter(tag, "size", first)
        self._next_size = _counter(tag, "next_size", first)
        self._micro_step = _counter(tag, "micro_step", 0)
        self._optimizer_steps = _counter(tag, "optimizer_steps", 0, ms.int64)
        self._items = _counter(tag, "items", 0, ms.int64)
        self._grad_norm = _counter(tag, "grad_norm", 0.0, ms.float32)
        # The window's losses, weighted like its gradients, and how many micro-batches gave one.
        self._loss_sum = _counter(tag, "loss_sum", 0.0, ms.float32)
        self._loss_count = _counter(tag, "loss_count", 0)
        self._window_loss = _counter(tag, "window_loss", 0.0, ms.float32)
        self._has_window_loss = _counter(tag, "has_window_loss", 0)
        self._map = ops.HyperMap()

    # ------------------------------------------------------------------ graph methods
    def __call__(self, grads: Sequence[Tensor], n_items: Any = None, *, loss: Tensor | None = None) -> Tensor:
        """Add one micro-batch's gradients; step the optimizer when the window is complete.

        Args:
            grads: the gradients of the micro-batch's *mean* loss (``value_and_grad`` output),
                one per optimizer parameter, in order. Do not divide the loss by N: the
                accumulator normalizes.
            n_items: the micro-batch's number of items (``weighting="items"`` only, then on
                every call): an integer Tensor (its value is not read, so that the graph never
                waits for it) or a Python int >= 1 (checked; each new int value compiles anew
                inside ``@ms.jit``).
            loss: the micro-batch's mean loss (the ``value_and_grad`` value), to record the
                window's loss (:attr:`window_loss`); a float Tensor of one element.

        Returns:
            A bool Tensor: True when this call completed the window and the optimizer stepped.

        Raises:
            TypeError, ValueError: a bad ``n_items``, ``grads`` or ``loss``; inside ``@ms.jit``
                when the graph compiles, before anything changes.
        """
        check_call(len(self._grads), self.weighting, grads, n_items, loss)
        if n_items is None:
            added = self._add(grads)
            if loss is not None:
                added = ops.depend(added, self._add_loss(loss.reshape(()).astype(ms.float32)))
        else:
            count = Tensor(n_items, ms.int64) if isinstance(n_items, int) else (
                n_items.reshape(()).astype(ms.int64))
            added = self._add_weighted(grads, count)
            ops.assign_add(self._items, count)
            if loss is not None:
                weighted = loss.reshape(()).astype(ms.float32) * count.astype(ms.float32)
                added = ops.depend(added, self._add_loss(weighted))
        ops.assign_add(self._micro_step, Tensor(1, ms.int32))
        stepped = ops.depend(self._micro_step >= self._size, added)
        if stepped:
            # Assigned, not just called: inside a graph branch, MindSpore drops a call whose
            # result goes nowhere (a method returning None), side effects included.
            stepped = self._apply(self._totals())
        return stepped

    def flush(self) -> Tensor:
        """Apply a partial window now (end of data), as the mean over the micro-batches it holds.

        Call it outside the graph. Under data parallel every rank must call it: the ranks first
        agree on the window's length on the host (one all-gather of one number per rank), then
        the window is reduced (one all-reduce) and applied; when every window is empty nothing
        runs. The mean is over all the micro-batches the ranks held.

        Returns:
            A bool Tensor: True when the optimizer stepped, False when nothing was pending.

        Raises:
            ValueError: under data parallel, the ranks hold partial windows of different
                lengths; every rank raises, before anything changes.
        """
        if self._reduce is not None and agree_on_length(self.micro_step) == 0:
            return Tensor(False)
        return self._flush()

    def _flush(self) -> Tensor:
        totals = self._totals()
        stepped = totals[0] > 0
        if stepped:
            stepped = self._apply(totals)
        return stepped

    def discard(self) -> Tensor:
        """Drop the partial window: the next micro-batch starts a new one (every rank at once
        under data parallel)."""
        return self._reset()

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

    def _add_loss(self, value: Tensor) -> Tensor:
        ops.assign_add(self._loss_sum, value)
        return ops.assign_add(self._loss_count, Tensor(1, ms.int32))

    def _totals(self) -> Tensor:
        """The window's counters (micro-batches, items, loss sum, losses given), over all ranks.

        Under data parallel this is the window's one all-reduce, which also sums the buffers.
        """
        items = self._items
        local = ops.stack((self._micro_step.astype(ms.float32),
                           (items // ITEM_BASE).astype(ms.float32), (items % ITEM_BASE).astype(ms.float32),
                           self._loss_sum.value(), self._loss_count.astype(ms.float32)))
        if self._reduce is None:
            return local
        return self._reduce(self._grads, local, self._micro_step > 0).astype(ms.float32)

    def _apply(self, totals: Tensor) -> Tensor:
        micro = totals[0]
        # Under item weighting, both parts of the total are exact integers in float32 (so is
        # x ITEM_BASE, a power of two); their sum is rounded once, here.
        factor = 1.0 / (totals[1] * ITEM_BASE + totals[2]) if self.weighting == "items" else 1.0 / micro
        ops.assign(self._window_loss, totals[3] * factor)
        ops.assign(self._has_window_loss, (totals[4] == micro).astype(ms.int32))
        if self.clip_norm is not None:
            # The norm of the normalized gradient is factor x the buffer's; one scaling pass
            # applies both, with the coefficient torch's clip_grad_norm_ uses.
            norm = ops.sqrt(ops.addn(self._map(buffers.square_sum, self._grads))) * factor
            ops.assign(self._grad_norm, norm)
            factor = factor * ops.minimum(self.clip_norm / (norm + 1e-6), 1.0)
        self._map(ops.partial(buffers.scale_, factor), self._grads)
        self.optimizer(self._grads)
        ops.assign_add(self._optimizer_steps, Tensor(1, ms.int64))
        done = self._reset()
        self._reopen()
        return done

    def _reset(self) -> Tensor:
        ops.assign(self._items, Tensor(0, ms.int64))
        ops.assign(self._loss_sum, Tensor(0.0, ms.float32))
        ops.assign(self._loss_count, Tensor(0, ms.int32))
        ops.assign(self._micro_step, Tensor(0, ms.int32))
        return self._micro_step == 0

    def _reopen(self) -> None:
        # The schedule is read only here, when a window opens, as in the core.
        if self._by_epoch:
            ops.assign(self._size, self._next_size)
        elif self._table is not None:
            starts, sizes = self._table
            index = (starts <= self._optimizer_steps).astype(ms.int32).sum() - 1
            ops.assign(self._size, sizes[index])
