"""LoadBalance's hot path: no host read per micro-batch (a ``.item()`` waits for the device on a
GPU). The reads of a run are counted with a dispatch mode (``aten._local_scalar_dense``) on a
model of our own, which reads nothing itself, at two window sizes: they must not grow with the
window's micro-batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradaccum
from tests.moe.models import batches, count, lm_loss, tiny_moe


class HostReads(TorchDispatchMode):  # type: ignore[misc]
    """Counts the host reads (``.item()``, ``float()``, ``.tolist()``) dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def reads_of_a_run(mode: str, steps: int, windows: int = 3) -> int:
    model = tiny_moe()
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps)
    balance = gradaccum.moe.LoadBalance(model, routers=model.routers, top_k=2, coef=0.5, mode=mode)
    loader = [b for w in range(windows) for b in batches(w, sizes=(2,) * steps)]
    with HostReads() as reads:
        for window in balance.windows(loader, acc, n_items=count):
            for b in window:
                acc.backward(lm_loss(model(**b)["logits"], b["labels"]), n_items=count(b))
    assert acc.optimizer_steps == windows
    return reads.count


@pytest.mark.parametrize("mode", ["global", "rolling", "micro_batch"])
def test_no_host_read_per_micro_batch(mode):
    few, many = reads_of_a_run(mode, steps=2), reads_of_a_run(mode, steps=6)
    assert few > 0  # the count sees the window's own reads (its token totals, its check)
    assert many == few
