"""Rank side of test_rl_terms' two-rank tests: the `rl-terms` recipe of docs/INTEGRATIONS.md on a
DDP policy, each rank holding 4 of the 8 completions in 2 micro-batches; and the same recipe with
its totals summed over this rank only (the slip the accumulator now refuses on every rank). Run as
``python -m tests.integrations.rl_terms_ranks OUT`` under the torchrun environment (tests/ranks.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.integrations.common import run
from tests.ranks import run_scenarios
from tests.torch.test_terms import AUX, BETA, batch, chunks, fresh, per_token

SIZES = [2, 2]  # each rank's micro-batches


def compute_losses(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
    return per_token(model, inputs["x"], inputs["targets"], inputs["advantages"])


def recipe(rank: int, *replace: tuple[str, str]) -> dict[str, Any]:
    mine = [t[4 * rank: 4 * rank + 4] for t in batch()]
    windows = [[{"x": x, "targets": t, "advantages": a, "completion_mask": m}
                for x, t, a, m in chunks(mine, SIZES)]]
    model = DDP(fresh())
    ns = run("rl-terms", {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.5),
                          "gradient_accumulation_steps": len(SIZES), "windows": windows,
                          "compute_losses": compute_losses, "entropy_coef": BETA, "aux_coef": AUX},
             *replace)
    return {"params": torch.cat([p.detach().flatten() for p in model.module.parameters()]),
            "steps": ns["acc"].optimizer_steps}


def local_totals(rank: int) -> dict[str, Any]:
    try:
        recipe(rank, ("    if dist.is_initialized():\n        dist.all_reduce(totals)\n", ""))
    except ValueError as err:
        return {"raised": str(err)}
    return {"raised": None}


if __name__ == "__main__":
    run_scenarios({"recipe": lambda rank, world: recipe(rank),
                   "local_totals": lambda rank, world: local_totals(rank)})
