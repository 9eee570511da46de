"""The mixin: a LightningModule whose micro-batches feed one :class:`gradaccum.Accumulator`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from gradaccum.core.schedule import Schedule, StepsSpec, as_schedule
from gradaccum.integrations.lightning._checkpoint import CHECKPOINT_KEY, pack, this_rank
from gradaccum.integrations.lightning._trainer import count_step, ddp_model, plugin_scaler, split_schedulers
from gradaccum.integrations.lightning._usage import check_base_order, warn_if_nothing_fed
from gradaccum.torch.accumulator import Accumulator
from gradaccum.torch.distributed.base import SyncMode, check_sync_mode

__all__ = ["AccumulatorMixin"]


@dataclass
class _Pending:
    """The micro-batch that ``manual_backward`` hands on to ``backward`` (and what came of it)."""

    loss: torch.Tensor
    n_items: Any
    reduction: Any
    stepped: bool = False


class AccumulatorMixin:
    """Exact gradient accumulation for a LightningModule: put it first among the bases.

    The module switches to manual optimization; ``training_step`` computes the micro-batch's
    loss and calls :meth:`accumulate`. Leave ``accumulate_grad_batches`` and
    ``gradient_clip_val`` out of the ``Trainer`` (pass ``steps`` and ``clip_norm`` here).

    Args:
        *args: passed on to the next base's ``__init__`` (the LightningModule).
        steps: micro-batches per window: an int, or a schedule (see :class:`gradaccum.Accumulator`).
        clip_norm: clip the window gradient's global L2 norm to this value (``None``: no clip).
        accum_dtype: ``torch.float32`` to sum bf16/fp16 gradients in float32 (not under DDP).
        skip_nonfinite: without a scaler, skip a window whose gradient norm is inf or NaN.
        sync: ``"window"`` (one DDP gradient sync per window) or ``"micro_batch"``.
        **kwargs: passed on to the next base's ``__init__``.

    Raises:
        TypeError, ValueError: a bad ``steps`` or ``sync`` (the others are checked when training
            starts, where the Accumulator is built). A class that lists the LightningModule
            before the mixin raises TypeError where it is defined, naming the right order.

    Warns:
        UserWarning: once, when an epoch ran ``training_step`` without calling
            :meth:`accumulate` (nothing trained).

    Attributes:
        trainer: the LightningModule's trainer, which the mixin reads (strategy, precision,
            optimizers, last batch).
        automatic_optimization: set to False: the mixin steps the optimizer itself, once per
            window.

    Example:
        >>> import pytorch_lightning as pl
        >>> class Model(AccumulatorMixin, pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__(steps=4)
        ...         self.net = torch.nn.Linear(3, 1)
        ...     def training_step(self, batch, batch_idx):
        ...         loss = self.net(batch).pow(2).mean()
        ...         self.accumulate(loss)
        ...         return loss
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> Model().automatic_optimization
        False
    """

    trainer: Any  # these two come from the LightningModule this class is mixed into
    automatic_optimization: bool

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_base_order(cls, AccumulatorMixin)

    def __init__(
        self,
        *args: Any,
        steps: StepsSpec | Schedule,
        clip_norm: float | None = None,
        accum_dtype: torch.dtype | None = None,
        skip_nonfinite: bool = False,
        sync: SyncMode = "window",
        **kwargs: Any,
    ) -> None:
        schedule = as_schedule(steps)
        mode = check_sync_mode(sync)
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        self._gradaccum_options: dict[str, Any] = {"steps": schedule, "clip_norm": clip_norm,
                                                   "accum_dtype": accum_dtype,
                                                   "skip_nonfinite": skip_nonfinite, "sync": mode}
        self._gradaccum: Accumulator | None = None
        self._gradaccum_saved: dict[str, Any] | None = None  # a loaded checkpoint's state, to apply
        self._gradaccum_pending: _Pending | None = None
        self._gradaccum_epoch_schedulers: list[Any] = []
        self._gradaccum_calls = {"training_step": 0, "accumulate": 0}  # this epoch's
        self._gradaccum_warned = False

    # ------------------------------------------------------------------ the user's one call
    @property
    def accumulator(self) -> Accumulator:
        """The :class:`gradaccum.Accumulator` (built when training starts).

        Raises:
            RuntimeError: before ``trainer.fit`` started training.
        """
        if self._gradaccum is None:
            raise RuntimeError("the accumulator is built when training starts (on_train_start); "
                               "call accumulate() from training_step")
        return self._gradaccum

    def accumulate(self, loss: torch.Tensor, n_items: Any = None, *, reduction: Any = "mean") -> bool:
        """Feed one micro-batch (call it once from ``training_step``, in place of the backward).

        The loss goes through ``manual_backward``, so the strategy and the precision plugin see
        it as Lightning expects; DDP synchronizes only the window's last backward. The epoch's
        last batch flushes a partial window.

        Args:
            loss: the micro-batch's loss (its mean over the items, or its sum with
                ``reduction="sum"``), as for :meth:`gradaccum.Accumulator.backward`.
            n_items: the micro-batch's item count (non-padding tokens) or weight.
            reduction: ``"mean"`` or ``"sum"``.

        Returns:
            True when the optimizer stepped (a window completed or was flushed).

        Raises:
            TypeError, ValueError: what :meth:`gradaccum.Accumulator.backward` raises.
        """
        acc = self.accumulator
        self._gradaccum_calls["accumulate"] += 1
        pending = _Pending(loss, n_items, reduction)
        last = acc.micro_step + 1 >= acc.steps
        self._gradaccum_pending = pending
        try:
            with self._backward_sync(last):
                self.manual_backward(loss)  # type: ignore[attr-defined]
        finally:
            self._gradaccum_pending = None
        stepped = pending.stepped
        if self.trainer.is_last_batch and acc.micro_step > 0:
            stepped = acc.flush() or stepped
        return stepped

    def accumulate_cached(self, encode: Callable[[Any], Any], loss_fn: Callable[..., torch.Tensor],
                          chunks: Iterable[Any], n_items: Any = None, *, reduction: Any = "mean") -> bool:
        """Feed one batch of a coupled (contrastive) loss from ``training_step``, by representation
        caching: :meth:`gradaccum.Accumulator.backward_cached` (docs/CONTRASTIVE.md), then, at
        the epoch's last batch, the partial window is flushed as :meth:`accumulate` does.

        ``encode`` calls the module's own layers; under ``strategy="ddp"`` the call arms DDP's
        reducer for the chunk that reduces (Lightning's DDP wrapper is the ``training_step``
        itself), so the gradients are averaged once per window and ``loss_fn`` sees the outputs
        of every rank. The precision plugin's autocast covers both passes; its scaler scales the
        representation gradient once.

        Args:
            encode: ``encode(chunk)`` returns a tensor or tuple of tensors (dim 0: examples).
            loss_fn: ``loss_fn(*reps)`` returns the batch's scalar loss.
            chunks: the batch's micro-batches (:func:`gradaccum.chunks`).
            n_items: this rank's items, as for :meth:`accumulate`.
            reduction: ``"mean"`` or ``"sum"``.

        Returns:
            True when the optimizer stepped (a window completed or was flushed).

        Raises:
            TypeError, ValueError, RuntimeError: what :meth:`gradaccum.Accumulator.backward_cached`
                raises.

        Example:
            >>> import gradaccum, pytorch_lightning as pl
            >>> class Pairs(AccumulatorMixin, pl.LightningModule):
            ...     def __init__(self):
            ...         super().__init__(steps=2)
            ...         self.encoder = torch.nn.Linear(3, 2)
            ...     def training_step(self, batch, batch_idx):
            ...         loss_fn = lambda z: torch.nn.functional.cross_entropy(z @ z.T, torch.arange(len(z)))
            ...         self.accumulate_cached(self.encoder, loss_fn, gradaccum.chunks(batch, 4))
            ...     def configure_optimizers(self):
            ...         return torch.optim.SGD(self.parameters(), lr=0.1)
            >>> Pairs().automatic_optimization
            False
        """
        acc = self.accumulator
        stepped = acc.backward_cached(encode, loss_fn, chunks, n_items, reduction=reduction)
        if self.trainer.is_last_batch and acc.micro_step > 0:
            stepped = acc.flush() or stepped
        return stepped

    @contextlib.contextmanager
    def _backward_sync(self, last: bool) -> Iterator[None]:
        """DDP's sync flag for this backward, the way Lightning sets it.

        Lightning's DDP strategy arms the reducer in ``manual_backward`` when the flag is set, and
        sets it again after every forward; so the flag is set here, right before the backward.
        """
        strategy = self.trainer.strategy
        ddp = strategy.model if isinstance(strategy.model, DistributedDataParallel) else None
        if ddp is None or last or self._gradaccum_options["sync"] == "micro_batch":
            if ddp is not None:
                ddp.require_backward_grad_sync = True
            yield
            return
        with strategy.block_backward_sync():
            yield

    # ------------------------------------------------------------------ Lightning's hooks
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning's backward hook: inside :meth:`accumulate`, the accumulator's backward.

        ``manual_backward`` reaches this hook with the loss the precision plugin scaled; the
        accumulator scales the unscaled loss itself with the same ``GradScaler``.
        """
        pending = self._gradaccum_pending
        if pending is None:
            super().backward(loss, *args, **kwargs)  # type: ignore[misc]
            return
        pending.stepped = self.accumulator.backward(pending.loss, pending.n_items,
                                                    reduction=pending.reduction)

    def on_train_start(self) -> None:
        """Build the accumulator from the trainer's optimizer, scheduler, scaler and model."""
        super().on_train_start()  # type: ignore[misc]
        if self._gradaccum is not None:
            return
        lightning_opt = self.optimizers()  # type: ignore[attr-defined]
        if isinstance(lightning_opt, list):
            raise ValueError(f"AccumulatorMixin needs exactly one optimizer from configure_optimizers, "
                             f"got {len(lightning_opt)}")
        trainer = self.trainer
        step_scheduler, self._gradaccum_epoch_schedulers = split_schedulers(trainer)
        # The raw optimizer, stepped by the accumulator: Lightning's wrapper would run the
        # precision plugin's unscale and step a second time.
        acc = Accumulator(lightning_opt.optimizer, model=ddp_model(trainer.strategy),
                          scheduler=step_scheduler, scaler=plugin_scaler(trainer.precision_plugin),
                          **self._gradaccum_options)
        if self._gradaccum_saved is not None:
            acc.load_state_dict(self._gradaccum_saved)
            self._gradaccum_saved = None
        acc.register_boundary_hook(lambda _: count_step(self.trainer))
        self._gradaccum = acc

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        """Count the epoch's ``training_step`` calls (to warn if none of them fed the accumulator)."""
        self._gradaccum_calls["training_step"] += 1
        super().on_train_batch_end(*args, **kwargs)  # type: ignore[misc]

    def on_train_epoch_end(self) -> None:
        """Flush a window left open (every rank) and step the per-epoch schedulers; warn once if
        the epoch ran ``training_step`` but never :meth:`accumulate`."""
        if self._gradaccum is not None:
            self._gradaccum.flush()
        for scheduler in self._gradaccum_epoch_schedulers:
            scheduler.step()
        calls = self._gradaccum_calls
        if not self._gradaccum_warned:
            self._gradaccum_warned = warn_if_nothing_fed(self, self.trainer.current_epoch,
                                                         calls["training_step"], calls["accumulate"])
        calls["training_step"] = calls["accumulate"] = 0
        super().on_train_epoch_end()  # type: ignore[misc]

    def on_validation_model_zero_grad(self) -> None:
        """Keep a partial window's gradients through validation (Lightning's default clears them)."""
        if self._gradaccum is None or self._gradaccum.micro_step == 0:
            super().on_validation_model_zero_grad()  # type: ignore[misc]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the accumulator's state; under DDP every rank's (each holds its own partial window)."""
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]
        state = self._gradaccum.state_dict() if self._gradaccum is not None else self._gradaccum_saved
        if state is not None:
            checkpoint[CHECKPOINT_KEY] = pack(state)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Take this rank's accumulator state from the checkpoint (applied when training starts)."""
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        state = this_rank(checkpoint.get(CHECKPOINT_KEY))
        self._gradaccum_saved = state
        if self._gradaccum is not None and state is not None:
            self._gradaccum.load_state_dict(state)
            self._gradaccum_saved = None
