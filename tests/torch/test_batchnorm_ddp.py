"""Window BatchNorm under DDP (2 CPU processes, gloo): sync=True pools the global batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

WORKER = Path(__file__).with_name("bn_ddp_worker.py")
WORLD = 2
WINDOWS = 2
Results = list[dict[str, dict[str, list[torch.Tensor]]]]  # per rank, per mode: stats and inputs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("bn_ddp")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(WORLD), port, str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    for p in procs:
        output, _ = p.communicate(timeout=120)
        assert p.returncode == 0, output
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


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
