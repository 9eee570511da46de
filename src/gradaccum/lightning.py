"""gradaccum inside a Lightning module: :class:`AccumulatorMixin` (docs/LIGHTNING.md).

Lightning's own ``accumulate_grad_batches`` divides every loss by N (the short last window too)
and weights micro-batches, not tokens. The mixin turns a LightningModule into one that feeds
each micro-batch to a :class:`gradaccum.Accumulator` and steps once per window, exactly:

* **DDP** (``strategy="ddp"``): every backward goes through ``manual_backward`` (so Lightning's
  strategy arms DDP's reducer and runs the precision plugin's and callbacks' backward hooks);
  off-boundary micro-batches run under ``strategy.block_backward_sync()``: one gradient
  all-reduce per window.
* **Precision plugins**: the accumulator gets the plugin's ``GradScaler`` (``"16-mixed"``) and
  steps the raw optimizer itself, so the plugin never unscales or steps a second time.
* **Schedulers** from ``configure_optimizers``: unwrapped and stepped per window
  (``interval="step"``) or per epoch (``"epoch"``).
* **Validation** in the middle of a window keeps the partial window (Lightning's default
  ``on_validation_model_zero_grad`` would clear it).
* **Checkpoints** hold the accumulator's state (every rank's under DDP): a mid-window resume is
  bitwise.
* **global_step** counts windows (one per optimizer step, a flushed last window included).

Lightning is not imported here: the mixin uses only the objects the trainer hands it, so it
works with ``pytorch_lightning`` and ``lightning.pytorch`` alike, and ``import gradaccum`` never
loads either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import ReduceLROnPlateau

from gradaccum.core.schedule import Schedule, StepsSpec, as_schedule
from gradaccum.torch.accumulator import Accumulator
from gradaccum.torch.distributed.base import SyncMode, check_sync_mode

__all__ = ["CHECKPOINT_KEY", "AccumulatorMixin"]

CHECKPOINT_KEY = "gradaccum"  # the accumulator's entry in a Lightning checkpoint


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
            starts, where the Accumulator is built).

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

    trainer: Any  # these four come from the LightningModule this class is mixed into
    automatic_optimization: bool

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
        step_scheduler, self._gradaccum_epoch_schedulers = _schedulers(self.trainer)
        opts = self._gradaccum_options
        acc = Accumulator(lightning_opt.optimizer, opts["steps"], model=_model(self.trainer.strategy),
                          clip_norm=opts["clip_norm"], scheduler=step_scheduler,
                          scaler=_scaler(self.trainer.precision_plugin), accum_dtype=opts["accum_dtype"],
                          skip_nonfinite=opts["skip_nonfinite"], sync=opts["sync"])
        if self._gradaccum_saved is not None:
            acc.load_state_dict(self._gradaccum_saved)
            self._gradaccum_saved = None
        acc.register_boundary_hook(lambda _: _count_step(self.trainer))
        self._gradaccum = acc

    def on_train_epoch_end(self) -> None:
        """Flush a window left open (every rank) and step the per-epoch schedulers."""
        if self._gradaccum is not None:
            self._gradaccum.flush()
        for scheduler in self._gradaccum_epoch_schedulers:
            scheduler.step()
        super().on_train_epoch_end()  # type: ignore[misc]

    def on_validation_model_zero_grad(self) -> None:
        """Keep a partial window's gradients through validation (Lightning's default clears them)."""
        if self._gradaccum is None or self._gradaccum.micro_step == 0:
            super().on_validation_model_zero_grad()  # type: ignore[misc]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save the accumulator's state; under DDP every rank's (each holds its own partial window)."""
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]
        state = self._gradaccum.state_dict() if self._gradaccum is not None else self._gradaccum_saved
        if state is None:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, _to_cpu(state))
            checkpoint[CHECKPOINT_KEY] = {"ranks": ranks}
        else:
            checkpoint[CHECKPOINT_KEY] = state

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Take this rank's accumulator state from the checkpoint (applied when training starts)."""
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        state = checkpoint.get(CHECKPOINT_KEY)
        if isinstance(state, dict) and "ranks" in state:
            ranks = state["ranks"]
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            if len(ranks) != (dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1):
                raise ValueError(f"the checkpoint holds the accumulator states of {len(ranks)} ranks; "
                                 "resume on as many")
            state = ranks[rank]
        self._gradaccum_saved = state
        if self._gradaccum is not None and state is not None:
            self._gradaccum.load_state_dict(state)
            self._gradaccum_saved = None


def _model(strategy: Any) -> torch.nn.Module | None:
    """The module the forward runs through: the DDP wrapper, or None on one device.

    Raises:
        ValueError: a strategy whose wrapper gradaccum cannot sync once per window (FSDP,
            DeepSpeed, ...).
    """
    model = strategy.model
    if isinstance(model, DistributedDataParallel):
        return model
    if model is strategy.lightning_module:
        return None
    raise ValueError(f"AccumulatorMixin supports one device and strategy='ddp' (or 'ddp_spawn'); "
                     f"{type(strategy).__name__} wraps the model in {type(model).__name__}")


def _scaler(plugin: Any) -> torch.amp.GradScaler | None:
    """The precision plugin's ``GradScaler`` (``"16-mixed"``), which the accumulator then drives."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def _schedulers(trainer: Any) -> tuple[Any, list[Any]]:
    """The raw schedulers of ``configure_optimizers``: the per-step one (for the accumulator, which
    steps it once per optimizer step) and the per-epoch ones.

    Raises:
        ValueError: more than one per-step scheduler, a ``frequency`` other than 1, or a scheduler
            that needs a metric (ReduceLROnPlateau: step it yourself).
    """
    per_step: list[Any] = []
    per_epoch: list[Any] = []
    for config in trainer.lr_scheduler_configs:
        plateau = config.reduce_on_plateau or isinstance(config.scheduler, ReduceLROnPlateau)
        if config.frequency != 1 or plateau:
            raise ValueError(f"lr_scheduler {type(config.scheduler).__name__} (frequency="
                             f"{config.frequency}, monitor={config.monitor!r}) is not stepped by "
                             "AccumulatorMixin: leave it out of configure_optimizers and step it "
                             "yourself when accumulate() returns True")
        (per_step if config.interval == "step" else per_epoch).append(config.scheduler)
    if len(per_step) > 1:
        raise ValueError(f"AccumulatorMixin steps one per-step lr_scheduler, got {len(per_step)}")
    return (per_step[0] if per_step else None), per_epoch


def _count_step(trainer: Any) -> None:
    """Count one optimizer step in ``trainer.global_step`` (the accumulator stepped the raw
    optimizer itself), as ``LightningOptimizer.step`` counts it under manual optimization.

    Through the loop's progress record, not the optimizer's hooks: Lightning binds those only
    while ``training_step`` runs, and a window may be flushed at the epoch's end.
    """
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
    progress.increment_ready()
    progress.increment_completed()


def _to_cpu(state: Any) -> Any:
    """``state`` with every tensor on the CPU (for ``all_gather_object``)."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_cpu(v) for v in state)
    return state
