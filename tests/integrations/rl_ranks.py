"""Rank side of test_rl's two-rank test: the RL recipe on a DDP policy, each rank holding its
share of the rollouts in micro-batches of uneven sizes. Run as ``python -m
tests.integrations.rl_ranks OUT`` under the torchrun environment (tests/ranks.py)."""

from __future__ import annotations

import functools
from typing import Any

from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum.integrations.rl import LOSS_TYPES
from tests.integrations.policy import rollouts
from tests.integrations.test_rl import recipe_run
from tests.ranks import run_scenarios
from tests.reference import tiny_lm

SIZES = {0: [3, 1], 1: [2, 2]}  # per rank: 4 sequences each, in micro-batches of uneven sizes


def scenario(loss_type: str, rank: int, world: int) -> dict[str, Any]:
    batch = rollouts(8)
    mine = {k: v[4 * rank:4 * rank + 4] for k, v in batch.items()}
    model = DDP(tiny_lm())
    recipe_run(loss_type, mine, [SIZES[rank]], steps=2, model=model)
    return {"params": [p.detach().clone() for p in model.module.parameters()]}


if __name__ == "__main__":
    run_scenarios({t: functools.partial(scenario, t) for t in LOSS_TYPES})
