"""Rank side of tests/distributed/test_pipeline.py's 4-process launch: 4 stages, and PP x DP 2 x 2."""

from __future__ import annotations

from tests.distributed.pipeline_ranks import train
from tests.ranks import run_scenarios

if __name__ == "__main__":
    run_scenarios({
        "gpipe4_sum_clip": lambda r, w: train(r, w, "gpipe", clip=0.05),
        "1f1b4_mean": lambda r, w: train(r, w, "1f1b", reduction="mean", clip=None),
        "ppdp_1f1b_sum_clip": lambda r, w: train(r, w, "1f1b", pp=2, dp="ddp", clip=0.05),
        "ppdp_gpipe_mean": lambda r, w: train(r, w, "gpipe", pp=2, dp="ddp", reduction="mean", clip=None),
        "ppdp_fsdp_1f1b_sum_clip": lambda r, w: train(r, w, "1f1b", pp=2, dp="fsdp", clip=0.05),
    })
