"""Rank side of the data-parallel tests in tests/integrations/test_cached.py: backward_cached
through Lightning's ``strategy="ddp"`` and through Accelerate's MULTI_CPU (2 gloo ranks).

Run as ``python -m tests.integrations.cached_ranks OUT`` under the torchrun environment
(tests/ranks.py). Every rank trains its share of each global batch of pairs; the test compares
with one process on the global batches.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from tests.contrastive import pairs
from tests.ranks import run_scenarios

BATCHES, ROWS = 4, 12  # global batches of 2 x 12 pairs: 2 windows of 2


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [pairs(2 * ROWS, seed=60 + b) for b in range(BATCHES)]


def share(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[rank * ROWS:(rank + 1) * ROWS], t[rank * ROWS:(rank + 1) * ROWS]) for x, t in global_batches()]


def counting(model: Any, calls: list[int]) -> None:
    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        calls.append(1)
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)


def lightning(rank: int, world: int, direct: bool) -> dict[str, Any]:
    import pytorch_lightning as pl

    from tests.integrations.lightning_common import ClipPairs, Loader, trainer

    calls: list[int] = []

    class Count(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
            counting(trainer.strategy.model, calls)

    model = ClipPairs(steps=2, direct=direct)
    run = trainer(devices=world, strategy="ddp", max_epochs=1, use_distributed_sampler=False,
                  callbacks=[Count()])
    run.fit(model, train_dataloaders=Loader(share(rank)))
    return {"params": [p.detach().clone() for p in model.towers.parameters()], "syncs": len(calls),
            "global_step": run.global_step}


def accelerate(rank: int, world: int) -> dict[str, Any]:
    import accelerate as acc_lib

    import gradaccum
    import gradaccum.integrations.accelerate as adapter
    from tests.contrastive import Towers, clip_loss

    os.environ["ACCELERATE_USE_CPU"] = "true"  # what `accelerate launch --cpu` sets: gloo on CPU
    accelerator = acc_lib.Accelerator(gradient_accumulation_steps=2)
    model = Towers()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    calls: list[int] = []
    counting(model, calls)
    acc = adapter.Accumulator(accelerator, opt, model=model)
    flags = []
    for batch in share(rank):
        acc.backward_cached(lambda c: model(*c), lambda i, t: clip_loss(i, t, model.module.logit_scale),
                            gradaccum.chunks(batch, 4))
        flags.append(accelerator.sync_gradients)
    return {"params": [p.detach().clone() for p in model.module.parameters()], "syncs": len(calls),
            "flags": flags, "world": accelerator.num_processes, "type": str(accelerator.distributed_type)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_scenarios({
        "lightning": lambda r, w: lightning(r, w, direct=False),
        "lightning_direct": lambda r, w: lightning(r, w, direct=True),
        "accelerate": accelerate,
    })
