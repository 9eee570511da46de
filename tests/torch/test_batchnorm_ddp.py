"""Window BatchNorm under DDP (2 CPU processes, gloo): sync=True pools the global batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'

WINDOWS = 2  # as in batchnorm_ranks.py
Results = list[dict[str, Any]]  # per rank, per mode: stats and inputs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    saved = run_ranks("tests.torch.batchnorm_ranks", tmp_path_factory.mktemp("bn_ddp"), timeout=180.0)
    for mode in ("sync", "local"):
        scenario(saved, mode)  # fails with the rank's traceback if the mode raised there
    return saved


def global_batch_stats(ranks: Results, mode: str) -> list[torch.Tensor]:
    """Each layer, one plain BatchNorm forward per window of all ranks' inputs of that window."""
    # Fresh copies of the worker's two layers (running statistics 0 and 1).
    layers = [nn.BatchNorm2d(3).double(), nn.BatchNorm1d(4).double()]
    stats = []
    for i, layer in enumerate(layers):
        per_rank = [r[mode]["inputs"][i].chunk(WINDOWS) for r in ranks]  # equal micro-batches per window
        for w in range(WINDOWS):
            layer.train()(torch.cat([chunks[w] for chunks in per_rank]))
        stats += [layer.running_mean, layer.running_var, layer.num_batches_tracked]
    return stats


def test_synced_window_stats_equal_the_global_batch_on_every_rank(ranks: Results) -> None:
    want = global_batch_stats(ranks, "sync")
    for r in ranks:
        for got, expected in zip(r["sync"]["stats"], want, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)


def test_unsynced_window_stats_are_one_ranks_batch_only(ranks: Results) -> None:
    # The negative twin: without sync, rank 1 keeps the statistics of its local batch.
    want = global_batch_stats(ranks, "local")
    assert not torch.allclose(ranks[1]["local"]["stats"][0], want[0], atol=1e-10, rtol=0)
