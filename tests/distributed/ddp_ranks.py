"""Rank side of tests/distributed/test_ddp.py: every DDP scenario, run once per launch.

Every rank generates the same global data from seeds, trains its share through a DDP model and
the Accumulator, and also computes the one-process full-batch reference on the whole global
batch (cheap at this size), so the test compares both without shipping models around.
Run as ``python -m tests.distributed.ddp_ranks OUT`` under the torchrun environment (see
tests/ranks.py).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.functional import cross_entropy
from torch.nn.parallel import DistributedDataParallel as DDP

import gradaccum
from tests.ranks import run_scenarios
from tests.reference import (
    D_IN,
    D_OUT,
    HIDDEN,
    bitwise_equal,
    data,
    make_optimizer,
    mlp,
    reference_steps,
    snapshot,
)

STEPS, MICRO, WINDOWS = 3, 4, 3


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def grads_of(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def share(x: torch.Tensor, y: torch.Tensor, rank: int, steps: int, micro: int) -> list[Any]:
    """This rank's micro-batches of a window's global batch (ranks take consecutive blocks)."""
    xs, ys = x.split(micro), y.split(micro)
    return [(xs[rank * steps + i], ys[rank * steps + i]) for i in range(steps)]


def reference(windows: list[tuple[torch.Tensor, torch.Tensor]], opt: str = "sgd",
              dtype: torch.dtype = torch.float64) -> tuple[list[torch.Tensor], list[float]]:
    model = mlp(dtype)
    losses = reference_steps(model, make_optimizer(opt, model.parameters()), windows)
    return params_of(model), losses


def counted(ddp: DDP) -> dict[str, int]:
    """Count DDP's gradient all-reduces (one call per bucket) and their payload bytes."""
    count = {"calls": 0, "bytes": 0}

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        count["calls"] += 1
        count["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return count


def windows_run(rank: int, world: int, sync: str | None) -> dict[str, Any]:
    """WINDOWS full windows; ``sync=None`` passes no model and ``sync="local"`` (DDP syncs every
    backward, gradaccum does nothing across ranks)."""
    ddp = DDP(mlp())
    count = counted(ddp)
    opt = make_optimizer("sgd", ddp.parameters())
    step_grads: list[Any] = []
    opt.register_step_pre_hook(lambda *_: step_grads.append(grads_of(ddp)))
    options: dict[str, Any] = {"sync": "local"} if sync is None else {"model": ddp, "sync": sync}
    acc = gradaccum.Accumulator(opt, STEPS, **options)
    calls, off_grads, losses, unchanged, windows = [], [], [], True, []
    for w in range(WINDOWS):
        x, y = data(world * STEPS * MICRO, seed=100 + w)
        windows.append((x, y))
        before = snapshot(ddp.module)
        for xb, yb in share(x, y, rank, STEPS, MICRO):
            stepped = acc.backward(cross_entropy(ddp(xb), yb))
            calls.append(count["calls"])
            if not stepped:
                unchanged = unchanged and bitwise_equal(ddp.module, before)
                off_grads.append(grads_of(ddp))
        assert acc.window_loss is not None
        losses.append(float(acc.window_loss))
    ref_params, ref_losses = reference(windows)
    return {"calls": calls, "bytes": count["bytes"], "step_grads": step_grads, "off_grads": off_grads,
            "losses": losses, "unchanged": unchanged, "params": params_of(ddp.module),
            "ref_params": ref_params, "ref_losses": ref_losses,
            "grad_bytes": sum(p.numel() * p.element_size() for p in ddp.parameters())}


class Branchy(nn.Module):
    """Two alternative first layers: a micro-batch uses one, so the other gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(D_IN, HIDDEN), nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, D_OUT)
        self.double()

    def forward(self, x: torch.Tensor, branch: int) -> torch.Tensor:
        return self.head(torch.tanh((self.a if branch == 0 else self.b)(x)))


# Branch per (window, rank, micro-batch). Window 0, rank 0 uses `a` only off-boundary (the
# pytorch #69031 case: DDP used to sync only what the last pass used); rank 1 never uses `b`.
BRANCHES = [[[0, 1], [0, 0]], [[1, 0], [1, 1]]]


def unused_parameters(rank: int, world: int) -> dict[str, Any]:
    steps = 2
    ddp = DDP(Branchy(), find_unused_parameters=True)
    opt = make_optimizer("sgd", ddp.parameters())
    acc = gradaccum.Accumulator(opt, steps, model=ddp)
    ref = Branchy()
    ref_opt = make_optimizer("sgd", ref.parameters())
    for w, pattern in enumerate(BRANCHES):
        x, y = data(world * steps * MICRO, seed=200 + w)
        for i, (xb, yb) in enumerate(share(x, y, rank, steps, MICRO)):
            acc.backward(cross_entropy(ddp(xb, pattern[rank][i]), yb))
        ref_opt.zero_grad(set_to_none=True)
        loss = sum(cross_entropy(ref(xb, pattern[r][i]), yb)
                   for r in range(world) for i, (xb, yb) in enumerate(share(x, y, r, steps, MICRO)))
        (loss / (world * steps)).backward()  # type: ignore[operator]
        ref_opt.step()
    return {"params": params_of(ddp.module), "ref_params": params_of(ref)}


# Micro-batch sizes per (window, rank): the ranks hold different item counts.
SIZES = [[[2, 6, 3], [5, 1, 4]], [[4, 4, 1], [3, 3, 3]]]


def uneven_items(rank: int, world: int) -> dict[str, Any]:
    ddp = DDP(mlp())
    acc = gradaccum.Accumulator(make_optimizer("sgd", ddp.parameters()), 3, model=ddp)
    naive = mlp()
    naive_opt = make_optimizer("sgd", naive.parameters())
    windows, losses = [], []
    for w, sizes in enumerate(SIZES):
        x, y = data(sum(map(sum, sizes)), seed=300 + w)
        windows.append((x, y))
        per_rank = list(zip(x.split([sum(s) for s in sizes]), y.split([sum(s) for s in sizes]), strict=True))
        xr, yr = per_rank[rank]
        for i, (xb, yb) in enumerate(zip(xr.split(sizes[rank]), yr.split(sizes[rank]), strict=True)):
            n: Any = len(yb) if rank == 0 else torch.tensor(len(yb))  # ints and tensors alike
            stepped = acc.backward(cross_entropy(ddp(xb), yb), n_items=n)
            assert stepped == (i == len(sizes[rank]) - 1)
        assert acc.window_loss is not None
        losses.append(float(acc.window_loss))
        # The naive twin: each rank normalizes by its own items, then ranks are averaged.
        naive_opt.zero_grad(set_to_none=True)
        (sum(cross_entropy(naive(xk), yk) for xk, yk in per_rank) / world).backward()  # type: ignore[operator]
        naive_opt.step()
    ref_params, ref_losses = reference(windows)
    return {"params": params_of(ddp.module), "losses": losses, "ref_params": ref_params,
            "ref_losses": ref_losses, "naive_params": params_of(naive)}


def flush_partial(rank: int, world: int) -> dict[str, Any]:
    """Windows of 2 (flushed), 4 (full) and 3 (flushed) micro-batches of 4, then an item-weighted
    partial window with uneven sizes, then a flush of an empty window."""
    steps = 4
    ddp = DDP(mlp())
    count = counted(ddp)
    opt = make_optimizer("sgd", ddp.parameters())
    step_grads: list[Any] = []
    opt.register_step_pre_hook(lambda *_: step_grads.append(grads_of(ddp)))
    acc = gradaccum.Accumulator(opt, steps, model=ddp)
    windows, losses, flushed, calls = [], [], [], []
    for w, fed in enumerate([2, 4, 3]):
        x, y = data(world * fed * MICRO, seed=400 + w)
        windows.append((x, y))
        for xb, yb in share(x, y, rank, fed, MICRO):
            acc.backward(cross_entropy(ddp(xb), yb))
        calls.append(count["calls"])
        flushed.append(acc.flush())
        assert acc.window_loss is not None
        losses.append(float(acc.window_loss))
    sizes = [[3, 1], [2, 5]]
    x, y = data(11, seed=450)
    windows.append((x, y))
    xr, yr = x.split([4, 7])[rank], y.split([4, 7])[rank]
    for xb, yb in zip(xr.split(sizes[rank]), yr.split(sizes[rank]), strict=True):
        acc.backward(cross_entropy(ddp(xb), yb), n_items=len(yb))
    flushed.append(acc.flush())
    assert acc.window_loss is not None
    losses.append(float(acc.window_loss))
    flushed.append(acc.flush())  # empty on every rank: a no-op, on both ranks alike
    ref_params, ref_losses = reference(windows)
    return {"flushed": flushed, "calls": calls, "step_grads": step_grads, "losses": losses,
            "params": params_of(ddp.module), "ref_params": ref_params, "ref_losses": ref_losses}


def unequal_flush(rank: int, world: int) -> dict[str, Any]:
    """Ranks flushing windows of different lengths get the same clear error, and can go on."""
    ddp = DDP(mlp())
    acc = gradaccum.Accumulator(make_optimizer("sgd", ddp.parameters()), 4, model=ddp)
    x, y = data(8 * MICRO, seed=500)
    for xb, yb in share(x, y, rank, 4, MICRO)[: rank + 1]:
        acc.backward(cross_entropy(ddp(xb), yb))
    message = ""
    try:
        acc.flush()
    except ValueError as e:
        message = str(e)
    acc.discard()
    for xb, yb in share(x, y, rank, 4, MICRO):
        acc.backward(cross_entropy(ddp(xb), yb))
    ref_params, _ = reference([(x, y)])  # the discarded micro-batches left no trace
    return {"message": message, "optimizer_steps": acc.optimizer_steps, "params": params_of(ddp.module),
            "ref_params": ref_params}


def acceptance(rank: int, world: int) -> dict[str, Any]:
    """The outside acceptance check's shape: model=ddp_model, only backward calls, float32."""
    ddp = DDP(mlp(torch.float32))
    optimizer = make_optimizer("adamw", ddp.parameters())
    acc = gradaccum.Accumulator(optimizer, 2, model=ddp)
    windows = []
    for w in range(3):
        x, y = data(world * 2 * MICRO, dtype=torch.float32, seed=600 + w)
        windows.append((x, y))
        for xb, yb in share(x, y, rank, 2, MICRO):
            acc.backward(cross_entropy(ddp(xb), yb))
    ref_params, _ = reference(windows, "adamw", torch.float32)
    try:
        gradaccum.check_batch_sizes(64, MICRO, acc.steps, acc.world_size)
        batch_error = ""
    except ValueError as e:
        batch_error = str(e)
    gradaccum.check_batch_sizes(world * 2 * MICRO, MICRO, acc.steps, acc.world_size)
    return {"params": params_of(ddp.module), "ref_params": ref_params, "world_size": acc.world_size,
            "optimizer_steps": acc.optimizer_steps, "batch_error": batch_error}


def grad_guards(rank: int, world: int) -> dict[str, Any]:
    """The once-per-window gradient check under DDP, sync "window" and "micro_batch", with and
    without gradient_as_bucket_view, a parameter unused in some micro-batches: two clean windows
    (silent, and the full batch's update), then an edit of one gradient on every rank (refused
    before the last micro-batch's backward on every rank, then discarded)."""
    out: dict[str, Any] = {}
    for sync in ("window", "micro_batch"):
        for view in (False, True):
            ddp = DDP(Branchy(), find_unused_parameters=True, gradient_as_bucket_view=view)
            acc = gradaccum.Accumulator(make_optimizer("sgd", ddp.parameters()), 2, model=ddp, sync=sync)
            ref = Branchy()
            ref_opt = make_optimizer("sgd", ref.parameters())
            for w, pattern in enumerate(BRANCHES):
                x, y = data(world * 2 * MICRO, seed=200 + w)
                for i, (xb, yb) in enumerate(share(x, y, rank, 2, MICRO)):
                    acc.backward(cross_entropy(ddp(xb, pattern[rank][i]), yb))
                ref_opt.zero_grad(set_to_none=True)
                loss = sum(cross_entropy(ref(xb, pattern[r][i]), yb)
                           for r in range(world) for i, (xb, yb) in enumerate(share(x, y, r, 2, MICRO)))
                (loss / (world * 2)).backward()  # type: ignore[operator]
                ref_opt.step()
            key = f"{sync}, bucket view {view}"
            out[key + ": params"] = (params_of(ddp.module), params_of(ref))
            x, y = data(world * 2 * MICRO, seed=250)
            (x0, y0), (x1, y1) = share(x, y, rank, 2, MICRO)
            acc.backward(cross_entropy(ddp(x0, 0), y0))
            if sync == "window":
                ddp.module.head.bias.grad.mul_(2)
            else:  # each backward's reduction rewrites .grad: only a cleared one is seen
                ddp.module.head.bias.grad = None
            try:
                acc.backward(cross_entropy(ddp(x1, 0), y1))
                out[key + ": edit"] = "not caught"
            except RuntimeError as e:
                out[key + ": edit"] = str(e)
            acc.discard()
    return out


def collectives(rank: int, world: int) -> dict[str, Any]:
    """Every all-reduce, per micro-batch and per flush: DDP's (its comm hook, one call per bucket)
    and the accumulator's own (all through ``RankGroups.all_reduce``), with their bytes.

    Two windows by the mean, one item-weighted window, then a partial window of 2 flushed.
    """
    from gradaccum.torch.distributed.collectives import RankGroups

    ddp = DDP(mlp())
    count = counted(ddp)
    own = {"calls": 0, "bytes": 0}
    real = RankGroups.all_reduce

    def all_reduce(self: RankGroups, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> None:
        own["calls"] += 1
        own["bytes"] += tensor.numel() * tensor.element_size()
        real(self, tensor, op)

    acc = gradaccum.Accumulator(make_optimizer("sgd", ddp.parameters()), STEPS, model=ddp)
    events: list[dict[str, Any]] = []

    def record(what: str, call: Any) -> None:
        before = (count["calls"], own["calls"], own["bytes"])
        call()
        events.append({"what": what, "ddp": count["calls"] - before[0], "own": own["calls"] - before[1],
                       "own_bytes": own["bytes"] - before[2]})

    RankGroups.all_reduce = all_reduce  # type: ignore[method-assign]
    try:
        for w, (fed, weighted) in enumerate([(STEPS, False), (STEPS, False), (STEPS, True), (2, False)]):
            x, y = data(world * fed * MICRO, seed=800 + w)
            for i, (xb, yb) in enumerate(share(x, y, rank, fed, MICRO)):
                n = len(yb) if weighted else None
                record(f"window {w} micro-batch {i}", lambda xb=xb, yb=yb, n=n: acc.backward(
                    cross_entropy(ddp(xb), yb), n_items=n))
        record("flush", acc.flush)
    finally:
        RankGroups.all_reduce = real  # type: ignore[method-assign]
    return {"events": events, "grad_bytes": sum(p.numel() * p.element_size() for p in ddp.parameters()),
            "buckets": events[STEPS - 1]["ddp"]}


def stalled_peer(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 raises mid-window and stops taking part; rank 0's boundary sync must not wait forever.

    The DDP model runs on its own group with a 3 s timeout (the bound under test); rank 1 waits
    for rank 0 on the default group meanwhile.
    """
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    ddp = DDP(mlp(), process_group=group)
    acc = gradaccum.Accumulator(make_optimizer("sgd", ddp.parameters()), 2, model=ddp)
    x, y = data(4 * MICRO, seed=700)
    (xa, ya), (xb, yb) = share(x, y, rank, 2, MICRO)
    acc.backward(cross_entropy(ddp(xa), ya))
    outcome = ""
    if rank == 0:
        try:
            acc.backward(cross_entropy(ddp(xb), yb))  # the boundary: DDP all-reduces here
            outcome = "completed"
        except RuntimeError as e:
            outcome = f"{type(e).__name__}: {e}"
    else:
        try:
            raise RuntimeError("a bad batch on rank 1")
        except RuntimeError as e:
            outcome = f"raised: {e}"
    dist.barrier()  # rank 1 waits here (default group) until rank 0 gave up
    return {"outcome": outcome}


if __name__ == "__main__":
    run_scenarios({
        "window": lambda r, w: windows_run(r, w, "window"),
        "micro_batch": lambda r, w: windows_run(r, w, "micro_batch"),
        "no_model": lambda r, w: windows_run(r, w, None),
        "unused_parameters": unused_parameters,
        "uneven_items": uneven_items,
        "flush_partial": flush_partial,
        "unequal_flush": unequal_flush,
        "acceptance": acceptance,
        "collectives": collectives,
        "grad_guards": grad_guards,
        "stalled_peer": stalled_peer,  # last: its group is left broken
    })
