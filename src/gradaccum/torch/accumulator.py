"""The PyTorch :class:`Accumulator`: N micro-batches, one exact optimizer update (docs/GUIDE.md)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch

from gradaccum.core.checkpoint import COUNTERS
from gradaccum.core.schedule import Schedule, StepsSpec, as_schedule
from gradaccum.core.validate import check_nonneg_int, check_optional_positive_float, check_positive_int
from gradaccum.core.window import Window, is_one
from gradaccum.torch._boundary import apply_window, largest, provisional_total
from gradaccum.torch._hooks import WindowHooks
from gradaccum.torch._micro_batch import MicroBatch, micro_batch_block
from gradaccum.torch._precision import Precision
from gradaccum.torch._state import check_state, pack_state, restore_grads
from gradaccum.torch._validate import Items, Reduction, Scheduler, check_items, check_loss, check_parts
from gradaccum.torch._window_loss import WindowLoss, sum_losses
from gradaccum.torch.distributed.base import GradSync, SyncMode
from gradaccum.torch.distributed.selector import make_sync

__all__ = ["Accumulator", "MicroBatch"]



class Accumulator(WindowHooks):
    """Accumulate the gradients of N micro-batches and apply them as one exact update.

    Gradients add up in ``.grad``; the parameters change only at a window's boundary (unscale,
    normalize, clip, step, scheduler, zero: docs/GUIDE.md). The window's gradient is the mean of
    its micro-batch gradients, or with ``n_items`` that of ``sum(n_i * loss_i) / sum(n_i)``.

    Args:
        optimizer: the ``torch.optim.Optimizer`` to step once per window (not one whose ``step``
            needs a closure, such as LBFGS).
        steps: micro-batches per window: an int, or a schedule (a mapping ``{optimizer_step: N}``,
            a callable, or a :class:`gradaccum.Schedule`) read when each window opens.
        model: the model the forward runs through; a ``DistributedDataParallel`` or FSDP2
            (``fully_shard``) module gets one gradient sync per window (docs/DISTRIBUTED.md).
        clip_norm: clip the window gradient's global L2 norm to this value (``None``: no clip).
        scheduler: an LR scheduler whose ``step()`` takes no argument, stepped once per
            optimizer step (step ReduceLROnPlateau yourself when :meth:`backward` returns True).
        scaler: a ``torch.amp.GradScaler``; pass the *unscaled* loss to :meth:`backward`.
        accum_dtype: ``torch.float32`` to sum bf16/fp16 gradients in float32 buffers (not under
            DDP/FSDP).
        skip_nonfinite: without a scaler, skip a window whose gradient norm is inf or NaN.
        sync: ``"window"`` (one gradient sync per window) or ``"micro_batch"`` (every backward).

    A skipped window (non-finite gradient, or a summed window of 0 items) changes no parameter
    and counts in :attr:`skipped_windows`. If anything raises at a boundary, the next window
    starts fresh: a failed window is never applied again (docs/GUIDE.md, "Failures").

    Raises:
        TypeError, ValueError: an argument of the wrong type or value (the message names it).

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> acc = Accumulator(opt, steps=2)
        >>> x, y = torch.randn(8, 4), torch.randn(8, 1)
        >>> [acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
        ...  for xb, yb in zip(x.split(2), y.split(2))]
        [False, True, False, True]
    """

    _window: Window

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        steps: StepsSpec | Schedule,
        *,
        model: torch.nn.Module | None = None,
        clip_norm: float | None = None,
        scheduler: Scheduler | None = None,
        scaler: torch.amp.GradScaler | None = None,
        accum_dtype: torch.dtype | None = None,
        skip_nonfinite: bool = False,
        sync: SyncMode = "window",
    ) -> None:
        self.schedule: Schedule = as_schedule(steps)
        check_parts(optimizer, model, scheduler, scaler)
        self.clip_norm = check_optional_positive_float("clip_norm", clip_norm)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._precision = Precision(optimizer, params, scaler=scaler, accum_dtype=accum_dtype,
                                    skip_nonfinite=skip_nonfinite, model=model)
        self._sync: GradSync = make_sync(model, sync)
        self.optimizer = optimizer
        self.model = model
        self.scheduler = scheduler
        self._params = params
        WindowHooks.__init__(self)
        self.optimizer_steps = 0
        self.skipped_windows = 0
        self.epoch = 0
        self.grad_norm: torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []  # this window's scaled losses (an append per micro-step)
        self._last_loss: WindowLoss | None = None
        self._most: Any = None  # largest micro-batch count of past windows (all ranks) / this window
        self._window_most: Any = None
        self._warned_no_grad = False
        self._open_window()

    @property
    def micro_step(self) -> int:
        """Micro-batches fed to the current window (0 right after a boundary)."""
        return self._window.micro_step

    @property
    def steps(self) -> int:
        """Micro-batches that complete the current window (N)."""
        return self._window.size

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The ``GradScaler`` given at construction, or None."""
        return self._precision.scaler

    @property
    def grad_sync(self) -> GradSync:
        """The gradient-sync strategy picked for ``model`` (where ranks agree, e.g. AutoBatch)."""
        return self._sync

    @property
    def window_loss(self) -> torch.Tensor | None:
        """The last applied window's loss, weighted like its gradient (a 0-dim tensor; ``None``
        before the first boundary). Under DDP/FSDP2 it is the loss over every rank's items.
        Summed when read (no cost for a loop that never logs it, no GPU sync)."""
        return None if self._last_loss is None else self._last_loss.value()

    @property
    def windows(self) -> int:
        """Windows applied so far: optimizer steps plus skipped windows."""
        return self.optimizer_steps + self.skipped_windows

    @property
    def world_size(self) -> int:
        """Data-parallel ranks the window's gradients are averaged over (1 without DDP/FSDP2)."""
        return self._sync.world_size

    def backward(self, loss: torch.Tensor, n_items: Items = None, *, reduction: Reduction = "mean") -> bool:
        """Feed one micro-batch: backward its loss into the window's gradient.

        Args:
            loss: the micro-batch's loss, a scalar that requires grad: its mean over the items
                (``reduction="mean"``, a criterion's default) or its sum (``"sum"``).
            n_items: the micro-batch's number of items (non-padding tokens) or total weight: an
                int, a float or a 0-dim tensor, >= 0 (> 0 with ``"mean"``). Give it on every
                micro-batch of a window or on none; ``"sum"`` requires it.
            reduction: ``"mean"`` or ``"sum"``. A summed micro-batch of 0 items adds nothing;
                a window whose total is 0 takes no step.

        Returns:
            True when this call completed the window and the optimizer stepped.

        Raises:
            TypeError, ValueError: a bad ``loss``, ``n_items`` or ``reduction``, or a window that
                would mix weightings; raised before anything changes.
        """
        n = check_items(n_items, reduction)
        check_loss(loss)
        window, factor = self._next(n, reduction == "sum")
        self._backward(loss, factor)
        return self._commit(window, n)

    @contextmanager
    def micro_batch(self, n_items: Items = None, *, reduction: Reduction = "mean") -> Iterator[MicroBatch]:
        """Feed one micro-batch whose loss comes from several forward graphs (multi-task).

        Call ``mb.backward(loss)`` right after each task's forward, so only one autograd graph is
        alive at a time; the block counts as one micro-batch and the handle closes with it. On an
        exception inside the block, call :meth:`discard`: its gradients are partly accumulated.

        Example:
            >>> model = torch.nn.Linear(3, 2)
            >>> acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps=1)
            >>> x = torch.randn(4, 3)
            >>> with acc.micro_batch() as mb:
            ...     mb.backward(model(x)[:, 0].pow(2).mean())
            ...     mb.backward(model(x)[:, 1].abs().mean())
            >>> mb.stepped
            True
        """
        n = check_items(n_items, reduction)
        window, factor = self._next(n, reduction == "sum")
        with micro_batch_block(self._backward, factor) as mb:
            yield mb
        mb.stepped = self._commit(window, n)

    def flush(self) -> bool:
        """Apply a partial window now (end of data), as the mean over what it holds; under
        DDP/FSDP2 every rank must call it. Returns True when the optimizer stepped.

        Raises:
            ValueError: under DDP/FSDP2, the ranks hold windows of different lengths (raised on
                every rank, before anything changes).
        """
        self._sync.sync_partial(self._params, self._window.micro_step)
        if self._window.empty:
            return False
        return self._apply()

    def discard(self) -> None:
        """Drop the partial window (gradients to None, counters to the window's start), then call
        the hooks of :meth:`register_discard_hook`."""
        self._sync.discard()
        self._reset()
        self._open_window()
        self._discard_hooks(self)

    def set_epoch(self, epoch: int) -> None:
        """Tell an epoch schedule (``Schedule(..., by="epoch")``) that epoch ``epoch`` begins; an
        empty window takes its N at once. Raises TypeError/ValueError unless ``epoch >= 0``."""
        self.epoch = check_nonneg_int("epoch", epoch)
        if self._window.empty:
            self._open_window()

    def resize_window(self, steps: int) -> None:
        """Give the current, empty window another size (for :class:`gradaccum.AutoBatch`, which
        learns a window's size from its data); the schedule is read again at the next window.
        Raises TypeError/ValueError for ``steps < 1`` or a started window (nothing changes)."""
        n = check_positive_int("steps", steps)
        if not self._window.empty:
            raise ValueError(f"resize_window(steps={n}) needs an empty window; it holds "
                             f"{self.micro_step} of {self.steps} micro-batches")
        self._window = self._window.resized(n)
        self._sync.prepare(self._window.next_is_last)

    def _open_window(self) -> None:
        count = self.epoch if self.schedule.by == "epoch" else self.optimizer_steps
        self._window = Window.open(self.schedule(count))
        self._sync.prepare(self._window.next_is_last)

    def _next(self, n: Any, summed: bool) -> tuple[Window, Any]:
        """The window after this micro-batch and its loss factor; changes nothing (may raise)."""
        window = self._window
        scale = self._provisional(n, window.size) if window.empty and n is not None else None
        nxt = window.advance(n, scale=scale, summed=summed)
        return nxt, nxt.loss_factor(n, summed=summed)

    def _provisional(self, n: Any, size: int) -> Any:
        """The item total the losses are scaled against: ``size`` times the largest count seen (so
        no factor exceeds 1/size once counts are known); across ranks, past windows' only."""
        if self._sync.world_size > 1:
            return float(size) if self._most is None else provisional_total(self._most, size)
        return provisional_total(largest(self._most, n), size)

    def _backward(self, loss: torch.Tensor, factor: Any) -> None:
        if not is_one(factor):
            loss = loss * (factor.to(loss.dtype) if isinstance(factor, torch.Tensor) else factor)
        self._precision.backward(loss)
        self._losses.append(loss.detach())

    def _commit(self, window: Window, n: Any) -> bool:
        self._window = window
        if n is not None:
            self._window_most = largest(self._window_most, n)
        if window.complete:
            return self._apply()
        if window.next_is_last:
            # DDP reads the flag in its forward, so it is set before the next micro-batch runs.
            self._sync.prepare(True)
        return False

    def _apply(self) -> bool:
        """The boundary, as a transaction: whatever raises, the next window starts fresh."""
        try:
            stepped = self._step(self._window)
        except BaseException:
            self._precision.abort()
            self._reset()
            with suppress(Exception):
                self._open_window()
            raise
        self._reset()
        try:
            self._hooks(self)
        finally:
            self._open_window()
        return stepped

    def _step(self, window: Window) -> bool:
        out = apply_window(window, self._losses, self._window_most, self._sync, self._precision,
                           self.clip_norm)
        self._most = largest(self._most, out.most)
        if out.loss is not None:
            self._last_loss = out.loss
            self.grad_norm = out.grad_norm
        if out.no_grads and not self._warned_no_grad:
            self._warned_no_grad = True
            warnings.warn("no parameter of the optimizer received a gradient in this window: does the "
                          "loss come from another model, or a detached graph?", stacklevel=5)
        if not out.stepped:
            self.skipped_windows += 1
            return False
        self.optimizer_steps += 1
        if self.scheduler is not None:
            self.scheduler.step()
        return True

    def _reset(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._precision.clear()
        self._losses = []
        self._window_most = None
        self._window = Window(self._window.size)

    def state_dict(self) -> dict[str, Any]:
        """All a bit-exact resume in the middle of a window needs (counters, window, partial
        gradients and losses, the last window's loss); save it beside the model's and optimizer's.

        Raises:
            RuntimeError: mid-window under FSDP2 with ``sync="window"``, whose partial gradients
                live inside FSDP2 (save at ``micro_step == 0``).
        """
        if not self._window.empty:
            self._sync.check_saveable()
        return pack_state(self._window, self.schedule.describe(), {k: getattr(self, k) for k in COUNTERS},
                          sum_losses(self._losses), self.window_loss, (self._most, self._window_most),
                          self._params, self._precision.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`, partial gradients included.

        Raises:
            TypeError, ValueError: a field is missing, of the wrong type or out of range (the
                message names the key), or the state comes from an accumulator with another
                ``steps`` or other parameters; nothing is changed then.
        """
        window = check_state(state, self.schedule.describe(), self._params)
        self._precision.check_state(state.get("accum"))
        restore_grads(self._params, state["grads"])
        self._precision.load_state_dict(state.get("accum"))
        for key in COUNTERS:
            setattr(self, key, state[key])
        self._losses = [] if state.get("loss_sum") is None else [state["loss_sum"]]
        last = state.get("window_loss")
        self._last_loss = None if last is None else WindowLoss((last,), 1.0)
        self._most, self._window_most = state.get("most_items"), state.get("window_most_items")
        self._window = window
        self._sync.prepare(window.next_is_last)

    def __repr__(self) -> str:
        steps, micro, done = self.schedule.describe(), self.micro_step, self.optimizer_steps
        return f"Accumulator(steps={steps!r}, micro_step={micro}, optimizer_steps={done})"
