"""The PyTorch :class:`Accumulator`: N micro-batches, one exact optimizer update."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from gradaccum.core import Schedule, Window, as_schedule, check_optional_positive_float
from gradaccum.core.checkpoint import window_from_record
from gradaccum.core.validate import check_nonneg_int, check_positive_int
from gradaccum.torch._grads import scale_and_clip_
from gradaccum.torch._hooks import HookList
from gradaccum.torch._precision import Precision
from gradaccum.torch._state import (
    FORMAT_VERSION,
    check_state,
    param_signature,
    restore_grads,
    snapshot_grads,
    window_state,
)
from gradaccum.torch._validate import check_items, check_loss, check_parts
from gradaccum.torch.distributed.base import GradSync, SyncMode
from gradaccum.torch.distributed.selector import make_sync

__all__ = ["Accumulator", "MicroBatch"]

BoundaryHook = Callable[["Accumulator"], None]


class Accumulator:
    """Accumulate the gradients of N micro-batches and apply them as one exact update.

    Gradients add up in ``.grad`` (no extra buffer). At each window boundary, in this order:
    unscale (``scaler``), normalize, clip the global L2 norm to ``clip_norm``, optimizer step
    (through the scaler), scaler update, scheduler step, ``zero_grad(set_to_none=True)``.
    Between boundaries the parameters are bitwise unchanged.

    Normalization: without ``n_items`` the window's gradient is the mean of its micro-batch
    gradients (a flushed window of r micro-batches is the mean over r); with ``n_items`` on every
    micro-batch it is the gradient of ``sum(n_i * loss_i) / sum(n_i)``, over all ranks under DDP
    and FSDP2 (every rank must feed the same number of micro-batches per window).

    Args:
        optimizer: the ``torch.optim.Optimizer`` to step once per window.
        steps: micro-batches per window: an int, or a schedule (a mapping ``{optimizer_step: N}``,
            a callable, or a :class:`gradaccum.Schedule`) read when each window opens.
        model: the model the forward runs through; a ``DistributedDataParallel`` or FSDP2
            (``fully_shard``) module gets one gradient sync per window (docs/DISTRIBUTED.md).
        clip_norm: clip the window gradient's global L2 norm to this value (``None``: no clip).
        scheduler: an LR scheduler, stepped once per optimizer step.
        scaler: a ``torch.amp.GradScaler``; pass the *unscaled* loss to :meth:`backward`. Each
            micro-batch's backward is scaled; the window's gradients are unscaled once, at the
            boundary; a window with an inf or NaN gradient is skipped whole (see below).
        accum_dtype: ``torch.float32`` to sum the gradients of bf16/fp16 parameters in float32
            buffers (one per such parameter, allocated on first use), normalized and clipped in
            float32 and cast into ``.grad`` once per window. Not under DDP/FSDP (ValueError).
        skip_nonfinite: without a scaler, skip a window whose gradient norm is inf or NaN (one
            foreach norm pass per window, none when ``clip_norm`` already computes it).
        sync: when a distributed ``model`` reduces gradients: ``"window"`` (once per window, on
            its last backward) or ``"micro_batch"`` (every backward; FSDP2 then holds only
            sharded gradients). No effect on a single process.

    A skipped window (scaler found an inf, or ``skip_nonfinite``) leaves the parameters and the
    optimizer untouched, does not step the scheduler, clears the gradients, adds one to
    :attr:`skipped_windows` (not to :attr:`optimizer_steps`) and makes :meth:`backward` return False.

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
        steps: Any,
        *,
        model: torch.nn.Module | None = None,
        clip_norm: float | None = None,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        accum_dtype: torch.dtype | None = None,
        skip_nonfinite: bool = False,
        sync: SyncMode = "window",
    ) -> None:
        schedule = as_schedule(steps)
        check_parts(optimizer, model, scheduler, scaler)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._precision = Precision(optimizer, params, scaler=scaler, accum_dtype=accum_dtype,
                                    skip_nonfinite=skip_nonfinite, model=model)
        self.clip_norm = check_optional_positive_float("clip_norm", clip_norm)
        self.optimizer = optimizer
        self.model = model
        self.scheduler = scheduler
        self.scaler = scaler
        self.schedule: Schedule = schedule
        self._params = params
        self._sync: GradSync = make_sync(model, sync)
        self._hooks = HookList()
        self._discard_hooks = HookList()
        self.optimizer_steps = 0
        self.skipped_windows = 0
        self.epoch = 0
        self._window_loss: torch.Tensor | None = None
        # The last window's (loss sum or micro-batch losses, factor), summed when first read.
        self._pending_loss: tuple[Any, Any] | None = None
        self.grad_norm: torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []  # scaled micro-batch losses, summed at the boundary
        self._open_window()

    # ------------------------------------------------------------------ counters
    @property
    def micro_step(self) -> int:
        """Micro-batches fed to the current window (0 right after a boundary)."""
        return self._window.micro_step

    @property
    def steps(self) -> int:
        """Micro-batches that complete the current window (N)."""
        return self._window.size

    @property
    def window_loss(self) -> torch.Tensor | None:
        """The last applied window's loss, weighted like its gradient (a 0-dim tensor; ``None``
        before the first boundary). Under DDP/FSDP2 it is the loss over every rank's items.

        Computed when first read (one sum over the window's micro-batch losses), so a loop
        that never logs it pays nothing; reading it does not synchronize a GPU.
        """
        if self._pending_loss is not None:
            value, factor = self._pending_loss
            self._pending_loss = None
            total = value if isinstance(value, torch.Tensor) or value is None else self._loss_sum(value)
            if total is not None and not (isinstance(factor, float) and factor == 1.0):
                total = total * factor
            self._window_loss = total
        return self._window_loss

    @property
    def windows(self) -> int:
        """Windows applied so far: optimizer steps plus windows skipped for non-finite grads."""
        return self.optimizer_steps + self.skipped_windows

    @property
    def world_size(self) -> int:
        """Data-parallel ranks the window's gradients are averaged over (1 without DDP/FSDP2).

        Check a configuration with
        ``gradaccum.check_batch_sizes(global_batch, micro_batch, acc.steps, acc.world_size)``.
        """
        return self._sync.world_size

    # ------------------------------------------------------------------ feeding
    def backward(self, loss: torch.Tensor, n_items: Any = None) -> bool:
        """Feed one micro-batch: backward its loss into the window's gradient.

        Args:
            loss: the micro-batch's mean loss (a criterion's default reduction), a scalar that
                requires grad.
            n_items: the micro-batch's number of items (samples, non-padding tokens): an int or
                an integer 0-dim tensor, >= 1. Give it on every micro-batch of a window or on none.

        Returns:
            True when this call completed the window and the optimizer stepped.

        Raises:
            TypeError, ValueError: a bad ``loss`` or ``n_items``, or a window that would mix
                weightings; raised before anything changes.
        """
        n = check_items(n_items)
        self._window.weighting_for(n)
        self._backward(loss, n)
        return self._end_micro_batch(n)

    @contextmanager
    def micro_batch(self, n_items: Any = None) -> Iterator[MicroBatch]:
        """Feed one micro-batch whose loss comes from several forward graphs (multi-task).

        Call ``mb.backward(loss)`` right after each task's forward, so only one autograd graph is
        alive at a time; the block counts as one micro-batch. On an exception inside the block,
        call :meth:`discard` before going on: its gradients are partly accumulated.

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
        n = check_items(n_items)
        self._window.weighting_for(n)
        mb = MicroBatch(self, n)
        yield mb
        mb.stepped = self._end_micro_batch(n)

    def flush(self) -> bool:
        """Apply a partial window now (end of data), as the mean over the micro-batches it holds.

        Under DDP or FSDP2 (``sync="window"``) every rank must call it: it reduces the window's
        gradients itself, since none of its backwards did.

        Returns:
            True when the optimizer stepped; False when nothing was pending (or the window was
            skipped for non-finite gradients).

        Raises:
            ValueError: under DDP/FSDP2, the ranks hold windows of different lengths (raised on
                every rank, before anything changes).
        """
        self._sync.sync_partial(self._params, self._window.micro_step)
        if self._window.empty:
            return False
        return self._apply()

    def discard(self) -> None:
        """Drop the partial window: gradients set to None, counters back to the window's start.

        Then calls the hooks of :meth:`register_discard_hook` (window state kept outside).
        """
        self.optimizer.zero_grad(set_to_none=True)
        self._sync.discard()
        self._precision.clear()
        self._losses = []
        self._open_window()
        self._discard_hooks(self)

    def set_epoch(self, epoch: int) -> None:
        """Tell an epoch schedule (``Schedule(..., by="epoch")``) that epoch ``epoch`` begins.

        Call it before the epoch's first micro-batch. An empty window takes the new N at once; a
        window carried over from the previous epoch keeps its N until its boundary.

        Raises:
            TypeError, ValueError: ``epoch`` is not an integer >= 0.
        """
        self.epoch = check_nonneg_int("epoch", epoch)
        if self._window.empty:
            self._open_window()

    def resize_window(self, steps: int) -> None:
        """Give the current, empty window another size: ``steps`` micro-batches complete it.

        For a caller that learns a window's size only when its data arrives, such as
        :class:`gradaccum.AutoBatch` (one global batch split into ``steps`` micro-batches). Under
        DDP the last of them still carries the window's single gradient sync. The schedule is
        read again when the next window opens.

        Raises:
            TypeError, ValueError: ``steps`` is not an integer >= 1, or the window already holds
                micro-batches; nothing changes then.
        """
        n = check_positive_int("steps", steps)
        if not self._window.empty:
            raise ValueError(f"resize_window(steps={n}) needs an empty window; it holds "
                             f"{self.micro_step} of {self.steps} micro-batches")
        self._window = self._window.resized(n)
        self._sync.prepare(self._window.next_is_last)

    def register_boundary_hook(self, hook: BoundaryHook) -> RemovableHandle:
        """Call ``hook(accumulator)`` after every window is applied (stepped or skipped).

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        return self._hooks.register(hook)

    def register_discard_hook(self, hook: BoundaryHook) -> RemovableHandle:
        """Call ``hook(accumulator)`` after :meth:`discard` drops a partial window.

        For state pooled over a window outside the accumulator (a window BatchNorm's statistics),
        which a discarded window must not leave behind.

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        return self._discard_hooks.register(hook)

    # ------------------------------------------------------------------ internals
    def _schedule_count(self) -> int:
        return self.epoch if self.schedule.by == "epoch" else self.optimizer_steps

    def _open_window(self) -> None:
        self._window = Window.open(self.schedule(self._schedule_count()))
        self._sync.prepare(self._window.next_is_last)

    def _backward(self, loss: torch.Tensor, n: Any) -> None:
        check_loss(loss)
        factor = self._window.loss_factor(n)
        scaled = loss if isinstance(factor, float) and factor == 1.0 else loss * factor
        self._precision.backward(scaled)
        # Kept as a list (an append, no tensor op per micro-step); summed at the boundary.
        self._losses.append(scaled.detach())

    def _end_micro_batch(self, n: Any) -> bool:
        self._window = self._window.advance(n)
        if self._window.complete:
            return self._apply()
        if self._window.next_is_last:
            # DDP reads the flag in its forward, so it is set before the next micro-batch runs.
            self._sync.prepare(True)
        return False

    def _apply(self) -> bool:
        window = self._window
        items = window.items if window.weighting == "items" else None
        if isinstance(items, torch.Tensor):
            items = items.to(torch.float64)  # 1 / an integer tensor would round to float32
        # One process: the window loss is summed only if someone reads it. Several: it must be
        # reduced now, in the same collective as the item count.
        distributed = self._sync.world_size > 1
        loss_sum, items = self._sync.reduce_window(self._loss_sum() if distributed else None, items)
        grads = self._precision.window_grads()
        factor = window.grad_factor(items)
        norm = scale_and_clip_(grads, factor, self.clip_norm)
        stepped, self.grad_norm = self._precision.step(grads, norm)
        if stepped:
            self.optimizer_steps += 1
            if self.scheduler is not None:
                self.scheduler.step()
        else:
            self.skipped_windows += 1
        self.optimizer.zero_grad(set_to_none=True)
        self._precision.clear()
        self._pending_loss = (loss_sum if distributed else self._losses, factor)
        self._window_loss = None
        self._losses = []
        # Emptied before the hooks and the schedule run: should either raise, the applied window
        # must not be applied a second time by the next micro-batch.
        self._window = Window(window.size)
        self._hooks(self)
        self._open_window()
        return stepped

    def _loss_sum(self, losses: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        losses = self._losses if losses is None else losses
        if not losses:
            return None
        return losses[0] if len(losses) == 1 else torch.stack(losses).sum()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """All a bit-exact resume in the middle of a window needs.

        Returns:
            A dict of counters, the window (size, micro-step, weighting, item total), the loss
            sum and copies of the partial gradients (and of the float32 buffers under
            ``accum_dtype``). Save it beside the model's and optimizer's.

        Raises:
            RuntimeError: mid-window under FSDP2 with ``sync="window"``, whose partial gradients
                live unsharded inside FSDP2, out of reach (save at ``micro_step == 0``).
        """
        if not self._window.empty:
            self._sync.check_saveable()
        return {
            "version": FORMAT_VERSION,
            "steps": self.schedule.describe(),
            "window": window_state(self._window),
            "optimizer_steps": self.optimizer_steps,
            "skipped_windows": self.skipped_windows,
            "epoch": self.epoch,
            "loss_sum": None if (loss_sum := self._loss_sum()) is None else loss_sum.clone(),
            "param_signature": param_signature(self._params),
            "grads": snapshot_grads(self._params),
            "accum": self._precision.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`, partial gradients included.

        Raises:
            TypeError, ValueError: the state is not one, or comes from an accumulator with another
                ``steps`` or other parameters; nothing is changed then.
        """
        check_state(state, self.schedule.describe(), self._params)
        self._precision.check_state(state.get("accum"))
        window = window_from_record(state["window"])
        restore_grads(self._params, state["grads"])
        self._precision.load_state_dict(state.get("accum"))
        self.optimizer_steps = state["optimizer_steps"]
        self.skipped_windows = state["skipped_windows"]
        self.epoch = state["epoch"]
        self._losses = [] if state["loss_sum"] is None else [state["loss_sum"]]
        self._window = window
        self._sync.prepare(window.next_is_last)

    def __repr__(self) -> str:
        return (f"Accumulator(steps={self.schedule.describe()!r}, micro_step={self.micro_step}, "
                f"optimizer_steps={self.optimizer_steps})")


class MicroBatch:
    """One micro-batch fed by several backward calls; see :meth:`Accumulator.micro_batch`."""

    def __init__(self, acc: Accumulator, n_items: Any) -> None:
        self._acc = acc
        self._n = n_items
        self.stepped = False

    def backward(self, loss: torch.Tensor) -> None:
        """Backward one task's loss (a mean over this micro-batch's items) right away."""
        self._acc._backward(loss, self._n)
