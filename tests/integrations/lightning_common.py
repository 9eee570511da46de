"""The Lightning test module and data, shared by tests/integrations/test_lightning.py and its DDP ranks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytorch_lightning as pl
import torch

import gradaccum
from gradaccum.integrations.lightning import AccumulatorMixin
from tests.contrastive import Towers, clip_loss, full_batch_grads
from tests.reference import PAD, lm_loss, padded, tiny_lm

Batch = tuple[torch.Tensor, torch.Tensor]
LR = 1e-2


def micro_batches(n: int, seed: int = 0) -> list[Batch]:
    """``n`` padded micro-batches of 3 sequences (1 to 7 tokens each: the token counts differ)."""
    return [padded(3, 7, seed=seed + i) for i in range(n)]


def tokens(batch: Batch) -> int:
    return int((batch[1] != PAD).sum())


class Loader:
    """The micro-batches in order, resumable mid-epoch (Lightning saves ``state_dict`` with the loops)."""

    def __init__(self, batches: Sequence[Batch]) -> None:
        self.batches, self.start, self.pos = list(batches), 0, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        self.pos, self.start = self.start, 0
        while self.pos < len(self.batches):
            self.pos += 1
            yield self.batches[self.pos - 1]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["pos"]


class TinyLM(AccumulatorMixin, pl.LightningModule):
    """The tiny language model with gradaccum: token-weighted, AdamW, an optional scheduler."""

    def __init__(self, steps: int = 4, scheduler: str | None = None, **options: Any) -> None:
        super().__init__(steps=steps, **options)
        self.net = tiny_lm()
        self.scheduler = scheduler
        self.val_losses: list[float] = []

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.net, *batch)
        self.accumulate(loss, n_items=tokens(batch))
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.val_losses.append(float(lm_loss(self.net, *batch)))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=LR)
        if self.scheduler is None:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.scheduler}}


def trainer(**kwargs: Any) -> pl.Trainer:
    """A quiet CPU trainer (no logger, checkpoints or progress bar unless asked)."""
    options: dict[str, Any] = {"accelerator": "cpu", "devices": 1, "logger": False,
                               "enable_checkpointing": False, "enable_progress_bar": False,
                               "enable_model_summary": False, "num_sanity_val_steps": 0}
    return pl.Trainer(**{**options, **kwargs})


def reference(windows: Sequence[Sequence[Batch]], scheduler: str | None = None,
              windows_per_epoch: int | None = None, clip_norm: float | None = None) -> torch.nn.Module:
    """The full batch: one AdamW step per window over every token of its micro-batches."""
    model = tiny_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = None if scheduler is None else torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    for i, window in enumerate(windows):
        opt.zero_grad(set_to_none=True)
        lm_loss(model, torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window])).backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        opt.step()
        epoch_end = windows_per_epoch is not None and (i + 1) % windows_per_epoch == 0
        if sched is not None and (scheduler == "step" or epoch_end):
            sched.step()
    return model


def windows_of(batches: Sequence[Batch], steps: int) -> list[list[Batch]]:
    """An epoch's windows: ``steps`` micro-batches each, a shorter last one."""
    return [list(batches[i:i + steps]) for i in range(0, len(batches), steps)]


def largest_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


class ClipPairs(AccumulatorMixin, pl.LightningModule):
    """CLIP's two towers and learnable temperature, each batch fed by representation caching:
    ``accumulate_cached`` (or, ``direct``, the accumulator's ``backward_cached`` itself)."""

    def __init__(self, steps: int = 2, direct: bool = False, chunks: int = 3, **options: Any) -> None:
        super().__init__(steps=steps, **options)
        self.towers = Towers()
        self.direct, self.chunks = direct, chunks

    def training_step(self, batch: Any, batch_idx: int) -> None:
        parts = gradaccum.chunks(batch, -(-len(batch[0]) // self.chunks))
        feed = self.accumulator.backward_cached if self.direct else self.accumulate_cached
        feed(lambda c: self.towers(*c), lambda i, t: clip_loss(i, t, self.towers.logit_scale), parts)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def clip_reference(windows: Sequence[Sequence[Any]]) -> torch.nn.Module:
    """The full batch: per window, the mean of its batches' CLIP losses, one SGD step."""
    model = Towers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for window in windows:
        opt.zero_grad(set_to_none=True)
        full_batch_grads(model, [[b] for b in window], lambda i, t: clip_loss(i, t, model.logit_scale))
        opt.step()
    return model
