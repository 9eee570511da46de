"""Rank side of tests/mindspore/test_data_parallel.py: every scenario, run once per msrun launch.

Every rank builds the same model and the same global data from seeds, feeds its share of each
window to a data-parallel Accumulator inside ``@ms.jit`` (the seed's step shape), and saves what
it saw to ``OUT/rank{r}.pkl``; the test computes the one-process reference itself.
Run as ``msrun ... python tests/mindspore/dp_ranks.py OUT`` (see ``msrun_command`` in tests/ranks.py).
"""

from __future__ import annotations

import pickle
import sys
import traceback
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.communication import get_group_size, get_rank, init

from gradaccum.mindspore import Accumulator
from gradaccum.mindspore.data_parallel import batchnorm_statistics
from tests.mindspore_reference import D_IN, D_OUT, HIDDEN, data, grad_fn, net, params

# Shared with the test: windows of STEPS micro-batches; each global micro-batch of
# GLOBAL_MICRO items is split between the ranks in consecutive blocks.
STEPS, WINDOWS, GLOBAL_MICRO, CLIP = 2, 3, 8, 0.5
ITEM_SIZES = ([5, 3], [1, 2])  # rank 0's and rank 1's micro-batches of the item-weighted window
FLUSH_STEPS = 3


@ms.jit_class
class CountingAllReduce:
    """An all-reduce that counts how often the graph runs it."""

    def __init__(self) -> None:
        self.op = ops.AllReduce(ops.ReduceOp.SUM)
        self.count = Parameter(Tensor(0, ms.int32), "all_reduce_count", requires_grad=False)

    def __call__(self, x: Tensor) -> Tensor:
        return ops.depend(self.op(x), ops.assign_add(self.count, Tensor(1, ms.int32)))


def counted(acc: Accumulator) -> CountingAllReduce:
    counter = CountingAllReduce()
    acc._reduce.all_reduce = counter  # before the first call compiles the graph
    return counter


def mean_windows(rank: int, world: int) -> dict[str, Any]:
    """Mean weighting, momentum and clipping: 3 windows of 2 micro-batches, then a flush of
    nothing (every rank empty: no step, no hang)."""
    x, y = data(WINDOWS * STEPS * GLOBAL_MICRO)
    model = net()
    acc = Accumulator(nn.Momentum(model.trainable_params(), 0.1, momentum=0.9), STEPS, clip_norm=CLIP)
    counter = counted(acc)
    fn = grad_fn(model)

    @ms.jit
    def train_step(xb: Tensor, yb: Tensor) -> tuple[Tensor, Tensor]:
        loss, grads = fn(xb, yb)
        return loss, acc(grads, loss=loss)

    local = GLOBAL_MICRO // world
    stepped, counts, losses, norms = [], [], [], []
    for i in range(WINDOWS * STEPS):
        start = i * GLOBAL_MICRO + rank * local
        _, done = train_step(x[start:start + local], y[start:start + local])
        stepped.append(bool(done))
        counts.append(int(counter.count.asnumpy()))
        if bool(done):
            losses.append(acc.window_loss)
            norms.append(acc.grad_norm)
    flushed = bool(acc.flush())
    return {"params": params(model), "stepped": stepped, "counts": counts, "losses": losses,
            "norms": norms, "flushed": flushed, "count_after_flush": int(counter.count.asnumpy()),
            "optimizer_steps": acc.optimizer_steps, "world_size": acc.world_size}


def item_window(rank: int, world: int) -> dict[str, Any]:
    """Item weighting, unequal micro-batches: one window of 11 items, 8 on rank 0, 3 on rank 1."""
    sizes = ITEM_SIZES[rank]
    x, y = data(sum(map(sum, ITEM_SIZES)))
    start = sum(map(sum, ITEM_SIZES[:rank]))
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), STEPS, weighting="items")
    fn = grad_fn(model)

    @ms.jit
    def train_step(xb: Tensor, yb: Tensor, n: Tensor) -> Tensor:
        loss, grads = fn(xb, yb)
        return acc(grads, n, loss=loss)

    for n in sizes:
        train_step(x[start:start + n], y[start:start + n], Tensor(n, ms.int32))
        start += n
    return {"params": params(model), "window_loss": acc.window_loss,
            "optimizer_steps": acc.optimizer_steps}


def partial_flush(rank: int, world: int) -> dict[str, Any]:
    """One full window, then a partial one of one micro-batch on every rank: flush on every rank."""
    local = GLOBAL_MICRO // world
    x, y = data((FLUSH_STEPS + 1) * GLOBAL_MICRO)
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), FLUSH_STEPS)
    counter = counted(acc)
    fn = grad_fn(model)
    for i in range(FLUSH_STEPS + 1):
        start = i * GLOBAL_MICRO + rank * local
        loss, grads = fn(x[start:start + local], y[start:start + local])
        acc(grads, loss=loss)  # eagerly, this time
    held = acc.micro_step
    flushed = bool(acc.flush())
    return {"params": params(model), "held": held, "flushed": flushed,
            "window_loss": acc.window_loss, "count": int(counter.count.asnumpy()),
            "optimizer_steps": acc.optimizer_steps}


def unequal_flush(rank: int, world: int) -> dict[str, Any]:
    """Partial windows of 2 and 1 micro-batches, then of 1 and 0: each flush raises on every rank
    and changes nothing."""
    x, y = data(4)
    model = net()
    acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), FLUSH_STEPS)
    fn = grad_fn(model)
    errors, unchanged = [], []
    for held in ((2, 1), (1, 0)):
        for _ in range(held[rank]):
            acc(fn(x, y)[1])
        before = (params(model), [b.asnumpy().copy() for b in acc._grads], acc.micro_step)
        try:
            acc.flush()
        except ValueError as err:
            errors.append(str(err))
        after = (params(model), [b.asnumpy().copy() for b in acc._grads], acc.micro_step)
        unchanged.append(before[2] == after[2] and all(
            (a == b).all() for a, b in zip(before[0] + before[1], after[0] + after[1], strict=True)))
        acc.discard()
    return {"errors": errors, "unchanged": unchanged, "optimizer_steps": acc.optimizer_steps,
            "flushed_after": bool(acc.flush())}


def bn_net() -> nn.Cell:
    """The test MLP with a BatchNorm between its layers (momentum 0.5: the statistics move fast)."""
    model = nn.SequentialCell(nn.Dense(D_IN, HIDDEN), nn.BatchNorm1d(HIDDEN, momentum=0.5), nn.Tanh(),
                              nn.Dense(HIDDEN, D_OUT))
    rng = np.random.default_rng(0)
    for p in model.trainable_params():
        p.set_data(Tensor(rng.normal(0.0, 0.5, p.shape).astype(np.float32)))
    return model


def batchnorm(rank: int, world: int) -> dict[str, Any]:
    """Two windows of 2 micro-batches on a BatchNorm model inside ``@ms.jit``, with and without
    average_batchnorm."""
    x, y = data(WINDOWS * STEPS * GLOBAL_MICRO)
    local = GLOBAL_MICRO // world
    out: dict[str, Any] = {}
    for name, average in (("averaged", True), ("plain", False)):
        model = bn_net()
        acc = Accumulator(nn.SGD(model.trainable_params(), 0.1), STEPS,
                          average_batchnorm=model if average else None)
        fn = grad_fn(model)
        model.set_train(True)

        @ms.jit
        def train_step(xb: Tensor, yb: Tensor, acc: Accumulator = acc, fn: Any = fn) -> Tensor:
            return acc(fn(xb, yb)[1])

        for i in range(2 * STEPS):
            start = i * GLOBAL_MICRO + rank * local
            train_step(x[start:start + local], y[start:start + local])
        out[name] = {"stats": [p.asnumpy().copy() for p in batchnorm_statistics(model)],
                     "params": params(model)}
    return out


SCENARIOS = {"mean": mean_windows, "items": item_window, "flush": partial_flush,
             "unequal": unequal_flush, "batchnorm": batchnorm}


def main() -> None:
    out = Path(sys.argv[1])
    ms.set_device("CPU")
    init()
    rank, world = get_rank(), get_group_size()
    results: dict[str, Any] = {}
    for name, scenario in SCENARIOS.items():
        try:
            results[name] = scenario(rank, world)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    with (out / f"rank{rank}.pkl").open("wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main()
