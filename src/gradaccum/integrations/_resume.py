"""Can a checkpoint that ``accelerator.save_state`` takes mid-epoch resume exactly? The Accelerate
adapter's check (docs/INTEGRATIONS.md, "Checkpoints in the middle of a window").

The checkpoint holds the model, optimizer, scheduler, RNG states and the accumulator's partial
window, not the dataloader's order. A restart that skips the epoch's first batches
(``skip_first_batches``) feeds the micro-batches the interrupted run would have fed only if it
draws the epoch's order again. A dataloader that does not shuffle does; so does a shuffled one
with Accelerate's seedable sampler (``DataLoaderConfiguration(use_seedable_sampler=True)``: the
order is a function of the seed and the epoch), provided the resumed run sets the epoch,
``train_dataloader.set_epoch(epoch)`` (a fresh dataloader counts its epochs from 0). Accelerate's
default shuffled dataloader does not: its ``RandomSampler`` draws the order from the global RNG
when the epoch starts, and the checkpoint restores the RNG as it was at the save, later.

:class:`ResumeCheck` warns, with the fix:

* at ``save_state`` in the middle of an epoch of a shuffled dataloader without a seedable sampler;
* at ``load_state`` of a checkpoint saved in the middle of an epoch (the save leaves a note in its
  folder, ``gradaccum_resume.json``), into a run whose dataloaders shuffle without one;
* after such a ``load_state``, at the first micro-batch of the resumed epoch and of the next one,
  when the dataloader's epoch is not the one the interrupted run had there (``set_epoch`` left
  out): a seedable order then differs.

It reads only what the accelerator and its dataloaders hold (the accelerator's save and load
pre-hooks): no global state.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from torch.utils.data import BatchSampler, RandomSampler

__all__ = ["ResumeCheck"]

NOTE = "gradaccum_resume.json"  # written into a save_state folder
FIX = ("pass dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True) to the Accelerator, "
       "and call train_dataloader.set_epoch(epoch) at the top of each epoch")


def sampler_of(loader: Any) -> Any:
    """The index sampler under a dataloader's batch samplers (Accelerate wraps the batch sampler
    to shard or skip batches; each wrapper holds the one it wraps as ``batch_sampler``)."""
    node: Any = getattr(loader, "batch_sampler", None) or getattr(loader, "sampler", None)
    for _ in range(8):
        if getattr(node, "batch_sampler", None) is not None:
            node = node.batch_sampler
        elif isinstance(getattr(node, "sampler", None), BatchSampler):
            node = node.sampler
        else:
            break
    return getattr(node, "sampler", node)


def order_lost(loader: Any) -> bool:
    """Does ``loader`` shuffle in an order a restart cannot draw again: a ``RandomSampler`` that is
    not Accelerate's seedable one, and no stateful dataloader (whose position the checkpoint keeps)?"""
    from accelerate.data_loader import SeedableRandomSampler

    if getattr(loader, "use_stateful_dataloader", False):
        return False
    sampler = sampler_of(loader)
    return isinstance(sampler, RandomSampler) and not isinstance(sampler, SeedableRandomSampler)


def order_by_epoch(loader: Any) -> bool:
    """Does ``loader``'s order depend on the epoch it is set to (a seedable or distributed
    shuffling sampler)?"""
    sampler = sampler_of(loader)
    return hasattr(sampler, "set_epoch") and (isinstance(sampler, RandomSampler)
                                              or bool(getattr(sampler, "shuffle", False)))


class ResumeCheck:
    """The adapter's data-order checks around ``save_state`` and ``load_state``.

    Args:
        accelerator: the ``accelerate.Accelerator``; its save and load pre-hooks are registered.
    """

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator
        self._expect: list[int] = []  # the epochs of the next passes after a resume, in order
        self._pass: tuple[Any, Any] | None = None  # (dataloader, its epoch) of the pass under way
        accelerator.register_save_state_pre_hook(self._saving)
        accelerator.register_load_state_pre_hook(self._loading)

    @property
    def pending(self) -> bool:
        """A resumed run whose next passes are still to be checked."""
        return bool(self._expect)

    def _active(self) -> Any:
        return self._accelerator.gradient_state.active_dataloader

    def _saving(self, models: Any, weights: Any, output_dir: str) -> None:
        loader = self._active()
        mid_epoch = loader is not None and not getattr(loader, "end_of_dataloader", False)
        if mid_epoch and order_lost(loader):
            warnings.warn("accelerator.save_state in the middle of an epoch of a shuffled dataloader "
                          "whose order a restart cannot draw again: a run resumed from this checkpoint "
                          f"feeds other micro-batches than this one would. To resume exactly, {FIX}",
                          UserWarning, stacklevel=3)
        if self._accelerator.is_main_process:
            epoch = getattr(loader, "iteration", None) if mid_epoch else None
            Path(output_dir, NOTE).write_text(json.dumps({"mid_epoch": mid_epoch, "epoch": epoch}) + "\n")

    def _loading(self, models: Any, input_dir: str) -> None:
        try:
            note = json.loads(Path(input_dir, NOTE).read_text())
        except (OSError, ValueError):
            return  # not saved through the adapter
        self._expect, self._pass = [], None
        if not note.get("mid_epoch"):
            return
        loaders = getattr(self._accelerator, "_dataloaders", [])
        if any(order_lost(loader) for loader in loaders):
            warnings.warn("accelerator.load_state of a checkpoint saved in the middle of an epoch, "
                          "into a run whose dataloader shuffles in an order it cannot draw again: the "
                          "resumed epoch feeds other micro-batches than the interrupted one. To resume "
                          f"exactly, {FIX}", UserWarning, stacklevel=3)
        elif isinstance(note.get("epoch"), int):
            self._expect = [note["epoch"], note["epoch"] + 1]

    def check(self) -> None:
        """Before a micro-batch of a resumed run: at the first of a pass, its dataloader's epoch
        must be the one the interrupted run had (checked for the resumed epoch and the next)."""
        loader = self._active()
        if loader is None:
            return
        current = (loader, getattr(loader, "iteration", None))
        if self._pass is not None and current[0] is self._pass[0] and current[1] == self._pass[1]:
            return
        self._pass = current
        want = self._expect.pop(0)
        if current[1] is not None and current[1] != want and order_by_epoch(loader):
            self._expect = []
            warnings.warn(f"this epoch's dataloader is at epoch {current[1]} after a resume, where the "
                          f"interrupted run was at epoch {want}: its shuffled order is another one. Call "
                          "train_dataloader.set_epoch(epoch) at the top of each epoch (before "
                          "skip_first_batches)", UserWarning, stacklevel=4)
