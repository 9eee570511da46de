"""Rank side of the DDP tests in tests/integrations/test_lightning.py (``strategy="ddp"``, 2 gloo ranks).

Run as ``python -m tests.integrations.lightning_ranks OUT`` under the torchrun environment
(tests/ranks.py): Lightning finds ``LOCAL_RANK`` set and the process group initialized, so it
launches nothing itself. Every rank trains its share of each window and computes the one-process
full-batch reference on the whole global batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from tests.integrations.lightning_common import Loader, TinyLM, micro_batches, reference, tokens, trainer
from tests.ranks import run_scenarios
from tests.reference import lm_loss

STEPS, PER_RANK, EPOCHS = 2, 5, 2  # windows of 2, 2 and a flushed 1 micro-batch per rank, per epoch
OUT = Path()
SYNCS: list[int] = []


def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
    """DDP's own all-reduce, counted."""
    SYNCS.append(1)
    return allreduce_hook(state, bucket)


class Probe(pl.Callback):
    """Counts DDP's gradient all-reduces (a comm hook: Lightning registers ``ddp_comm_hook`` on
    CUDA only), records the gradient after the first micro-batch (off-boundary) and saves a
    mid-window checkpoint."""

    def __init__(self, save: Path | None = None) -> None:
        self.off_boundary: list[torch.Tensor] = []
        self.save = save

    def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
        trainer.strategy.model.register_comm_hook(None, counting_hook)

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.current_epoch == 0 and batch_idx == 0:
            self.off_boundary = [p.grad.clone() for p in module.parameters()]
        if self.save is not None and trainer.current_epoch == 0 and batch_idx == 2:
            trainer.save_checkpoint(self.save)


class Unrouted(TinyLM):
    """The workaround the mixin replaces: the accumulator's backward called directly, outside
    ``manual_backward`` (Lightning's DDP never arms its reducer then)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.net, *batch)
        self.accumulator.backward(loss, n_items=tokens(batch))
        return loss


def fit(rank: int, world: int, sync: str = "window", probe: Probe | None = None,
        ckpt: Path | None = None, module: type[TinyLM] = TinyLM) -> tuple[TinyLM, pl.Trainer]:
    share = micro_batches(PER_RANK * world)[rank * PER_RANK:(rank + 1) * PER_RANK]
    model = module(steps=STEPS, sync=sync)
    run = trainer(devices=world, strategy="ddp", max_epochs=EPOCHS,
                  use_distributed_sampler=False, callbacks=[probe or Probe()])
    run.fit(model, train_dataloaders=Loader(share), ckpt_path=ckpt)
    return model, run


def global_windows(world: int) -> list[list[Any]]:
    batches = micro_batches(PER_RANK * world)
    shares = [batches[r * PER_RANK:(r + 1) * PER_RANK] for r in range(world)]
    epoch = [[b for s in shares for b in s[i:i + STEPS]] for i in range(0, PER_RANK, STEPS)]
    return epoch * EPOCHS


def exact(rank: int, world: int) -> dict[str, Any]:
    SYNCS.clear()
    probe = Probe(save=OUT / "mid.ckpt")
    model, run = fit(rank, world, probe=probe)
    ref = reference(global_windows(world))
    return {"params": [p.detach().clone() for p in model.parameters()],
            "reference": [p.detach().clone() for p in ref.parameters()],
            "off_boundary": probe.off_boundary, "syncs": len(SYNCS), "global_step": run.global_step,
            "windows": model.accumulator.windows}


def resume(rank: int, world: int) -> dict[str, Any]:
    model, run = fit(rank, world, ckpt=OUT / "mid.ckpt")
    return {"params": [p.detach().clone() for p in model.parameters()], "global_step": run.global_step}


def per_micro_batch(rank: int, world: int) -> dict[str, Any]:
    SYNCS.clear()
    model, _ = fit(rank, world, sync="micro_batch")
    return {"params": [p.detach().clone() for p in model.parameters()], "syncs": len(SYNCS)}


def unrouted(rank: int, world: int) -> dict[str, Any]:
    SYNCS.clear()
    model, _ = fit(rank, world, module=Unrouted)
    return {"params": [p.detach().clone() for p in model.parameters()], "syncs": len(SYNCS)}


def one_process_state(rank: int, world: int) -> dict[str, Any]:
    """A single process's mid-window state cannot be resumed by 2 ranks; a boundary state can."""
    from gradaccum.integrations.lightning._checkpoint import this_rank

    boundary = {"window": {"micro_step": 0}}
    try:
        this_rank({"window": {"micro_step": 2}})
    except ValueError as error:
        return {"error_message": str(error), "boundary": this_rank(boundary) is boundary}
    return {"error_message": None}


if __name__ == "__main__":
    import sys

    OUT = Path(sys.argv[1])
    torch.set_num_threads(1)
    run_scenarios({"exact": exact, "resume": resume, "per_micro_batch": per_micro_batch,
                   "unrouted": unrouted, "one_process_state": one_process_state})
