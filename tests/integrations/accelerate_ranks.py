"""Rank side of test_accelerate's two-process test: the run-clm port under Accelerate's MULTI_CPU
(gloo), started by tests.ranks.run_ranks with the torchrun environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tests.integrations.common import padded_text, run
from tests.integrations.test_accelerate import SETTINGS, TWO_RANK_SEQUENCES, gpt2
from tests.ranks import _exit_rank

if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ["ACCELERATE_USE_CPU"] = "true"  # what `accelerate launch --cpu` sets: gloo on CPU
    loader = torch.utils.data.DataLoader(padded_text(TWO_RANK_SEQUENCES), batch_size=4)
    ns = run("run-clm", {"model": gpt2(), "train_dataloader": loader, "gradient_accumulation_steps": 4,
                         **SETTINGS})
    accelerator = ns["accelerator"]
    torch.save({"world": accelerator.num_processes, "type": str(accelerator.distributed_type),
                "completed_steps": ns["completed_steps"],
                "params": [p.detach().clone() for p in ns["acc"].optimizer.param_groups[0]["params"]]},
               Path(sys.argv[1]) / f"rank{accelerator.process_index}.pt")
    _exit_rank()
