"""Lightning's ``accumulate_grad_batches`` against gradaccum's mixin, both against the full batch.

A tiny language model (an embedding, tanh and a linear head over 11 tokens, float64) learns
padded token sequences (targets -100 at padding): 10 micro-batches of 3 sequences (1 to 7 real
tokens each) per epoch, windows of 4 (so 4 + 4 + 2), AdamW (lr 1e-2), the loss a mean over the
real tokens. Three runs start from the same weights and see the same micro-batches:

* ``full batch``: one AdamW step per window on all its tokens at once (the reference, plain torch);
* ``Lightning accumulate_grad_batches=4``: a plain automatic-optimization LightningModule;
* ``gradaccum.lightning``: the same module with ``AccumulatorMixin`` (``n_items`` = real tokens).

It prints the machine, versions and threads and, for each epoch, the largest absolute parameter
difference from the full batch (smallest and largest over the seeds), and writes them as JSON.

    python benchmarks/lightning_accumulation.py [--seeds 5] [--epochs 3] [--threads 1]
        [--out docs/results/lightning_accumulation.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from gradaccum.bench.machine import describe_machine
from gradaccum.integrations.lightning import AccumulatorMixin

VOCAB, PAD, MICRO_BATCHES, STEPS, LR = 11, -100, 10, 4, 1e-2
ARMS = ("Lightning accumulate_grad_batches=4", "gradaccum.lightning")
Batch = tuple[torch.Tensor, torch.Tensor]


def tiny_lm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB)).double()


def lm_loss(net: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(tokens).flatten(0, 1), targets.flatten(), ignore_index=PAD)


def micro_batches(seed: int) -> list[Batch]:
    """An epoch's micro-batches: 3 sequences of 1 to 7 real tokens each, padded to 7."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (3, 7), generator=g)
        targets = torch.randint(0, VOCAB, (3, 7), generator=g)
        lengths = torch.randint(1, 8, (3,), generator=g)
        out.append((tokens, targets.masked_fill(torch.arange(7) >= lengths[:, None], PAD)))
    return out


class PlainLM(pl.LightningModule):
    """What a Lightning user writes: automatic optimization, the loss returned."""

    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_lm()

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return lm_loss(self.net, *batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


class GradaccumLM(AccumulatorMixin, PlainLM):
    """The same module through gradaccum: windows of STEPS, weighted by real tokens."""

    def __init__(self) -> None:
        super().__init__(steps=STEPS)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.net, *batch)
        self.accumulate(loss, n_items=(batch[1] != PAD).sum())
        return loss


class Snapshots(pl.Callback):
    """The parameters at the end of every epoch."""

    def __init__(self) -> None:
        self.epochs: list[list[torch.Tensor]] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.epochs.append([p.detach().clone() for p in module.parameters()])


def full_batch(batches: Sequence[Batch], epochs: int) -> list[list[torch.Tensor]]:
    net = tiny_lm()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    out = []
    for _ in range(epochs):
        for i in range(0, len(batches), STEPS):
            window = batches[i:i + STEPS]
            opt.zero_grad(set_to_none=True)
            lm_loss(net, torch.cat([b[0] for b in window]), torch.cat([b[1] for b in window])).backward()
            opt.step()
        out.append([p.detach().clone() for p in net.parameters()])
    return out


def lightning_run(arm: str, batches: Sequence[Batch], epochs: int) -> list[list[torch.Tensor]]:
    snapshots = Snapshots()
    plain = arm == ARMS[0]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=STEPS if plain else 1, callbacks=[snapshots])
    loader = DataLoader(list(batches), batch_size=None)
    trainer.fit(PlainLM() if plain else GradaccumLM(), train_dataloaders=loader)
    return snapshots.epochs


def largest_difference(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a, b, strict=True))


def measure(seeds: int, epochs: int) -> dict[str, list[list[float]]]:
    """``{arm: [[difference after each epoch] for each seed]}``."""
    diffs: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    for seed in range(seeds):
        batches = micro_batches(seed)
        reference = full_batch(batches, epochs)
        for arm in ARMS:
            run = lightning_run(arm, batches, epochs)
            diffs[arm].append([largest_difference(r, p) for r, p in zip(reference, run, strict=True)])
    return diffs


def table(diffs: dict[str, list[list[float]]], epochs: int) -> str:
    head = "| run | " + " | ".join(f"after epoch {e + 1}" for e in range(epochs)) + " |"
    rows = [head, "|---" * (epochs + 1) + "|"]
    for arm, per_seed in diffs.items():
        cells = [f"{min(s[e] for s in per_seed):.1e} to {max(s[e] for s in per_seed):.1e}"
                 for e in range(epochs)]
        rows.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")  # Lightning's advice (workers, logger) is not the measurement
    machine = describe_machine()
    for key, value in machine.items():
        print(f"{key:>14}: {value}")
    diffs = measure(args.seeds, args.epochs)
    print(f"\nlargest |parameter - full batch|, float64, {MICRO_BATCHES} micro-batches per epoch, "
          f"windows of {STEPS}, {args.seeds} data seeds (smallest to largest):\n")
    print(table(diffs, args.epochs))
    result = {"machine": {**machine, "pytorch_lightning": pl.__version__},
              "config": {"micro_batches_per_epoch": MICRO_BATCHES, "steps": STEPS, "lr": LR,
                         "dtype": "float64", "seeds": args.seeds, "epochs": args.epochs},
              "diffs": diffs,
              # The page's table: each arm's smallest and largest difference over the seeds.
              "range": {arm: {"min": [min(s[e] for s in per_seed) for e in range(args.epochs)],
                              "max": [max(s[e] for s in per_seed) for e in range(args.epochs)]}
                        for arm, per_seed in diffs.items()}}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
