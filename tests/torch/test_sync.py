"""Sync options on one process: validated up front, and a no-op without a distributed model."""

import pytest
import torch

import gradaccum
from tests.reference import data, mlp


def fresh(**kwargs):
    model = mlp()
    return model, gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, **kwargs)


@pytest.mark.parametrize("bad", ["every", "Window", None, 1])
def test_unknown_sync_mode_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"sync must be 'window', 'micro_batch' or 'local', got"):
        fresh(sync=bad)


@pytest.mark.parametrize("sync", ["window", "micro_batch", "local"])
def test_sync_mode_changes_nothing_on_one_process(sync):
    model, acc = fresh(model=None, sync=sync)
    x, y = data(8)
    for xb, yb in zip(x.split(4), y.split(4), strict=True):
        acc.backward(torch.nn.functional.cross_entropy(model(xb), yb))
    assert acc.optimizer_steps == 1 and acc.world_size == 1


def test_batch_sizes_check_with_the_accumulators_numbers():
    _, acc = fresh()
    gradaccum.check_batch_sizes(8, 4, acc.steps, acc.world_size)
    message = r"global batch 64 != micro_batch 4 x steps 2 x world_size 1 \(= 8\)"
    with pytest.raises(ValueError, match=message):
        gradaccum.check_batch_sizes(64, 4, acc.steps, acc.world_size)
