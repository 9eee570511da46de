"""What the mixin takes from a Lightning trainer: the model, the scaler, the schedulers, and the
step count. Lightning is not imported: these read the objects the trainer hands over."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import ReduceLROnPlateau

__all__ = ["count_step", "ddp_model", "plugin_scaler", "split_schedulers"]


def ddp_model(strategy: Any) -> torch.nn.Module | None:
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


def plugin_scaler(plugin: Any) -> torch.amp.GradScaler | None:
    """The precision plugin's ``GradScaler`` (``"16-mixed"``), which the accumulator then drives."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def split_schedulers(trainer: Any) -> tuple[Any, list[Any]]:
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


def count_step(trainer: Any) -> None:
    """Count one optimizer step in ``trainer.global_step`` (the accumulator stepped the raw
    optimizer itself), as ``LightningOptimizer.step`` counts it under manual optimization.

    Through the loop's progress record, not the optimizer's hooks: Lightning binds those only
    while ``training_step`` runs, and a window may be flushed at the epoch's end.
    """
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
    progress.increment_ready()
    progress.increment_completed()
