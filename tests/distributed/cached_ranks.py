"""Rank side of tests/distributed/test_cached_ddp.py: backward_cached under DDP and FSDP2 (gloo, CPU).

Every rank takes its share of each global batch, trains through the wrapped model, and computes
the one-process reference on the global batches itself (one forward and backward of each whole
batch, then the same optimizer steps), so the test compares the two without shipping models.
Run as ``python -m tests.distributed.cached_ranks OUT`` under the torchrun environment.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import gradaccum
from tests.contrastive import Encoders, Towers, clip_loss, full_batch_grads, pairs, sharded
from tests.ranks import run_scenarios

STEPS, WINDOWS, CHUNKS = 2, 2, 3
EVEN, UNEVEN = [12, 12], [14, 10]  # rows per rank of a global batch of 24


def global_batches(rows: list[int], seed: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [pairs(sum(rows), seed=seed + b) for b in range(STEPS * WINDOWS)]


def my_chunks(batch: Any, rows: list[int], rank: int, count: int = CHUNKS) -> list[Any]:
    """This rank's rows of ``batch`` (ranks take consecutive blocks) in ``count`` chunks."""
    start, mine = sum(rows[:rank]), rows[rank]
    parts = gradaccum.chunks(tuple(t[start:start + mine] for t in batch), -(-mine // count))
    assert len(parts) == count
    return parts


def reference(base: nn.Module, batches: list[Any], temperature: nn.Parameter | None = None,
              weights: list[float] | None = None) -> list[torch.Tensor]:
    """The one-process run: each window's full-batch gradient, one SGD step per window."""
    model = copy.deepcopy(base)
    temp = None if temperature is None else copy.deepcopy(temperature)
    params = [*model.parameters(), *([] if temp is None else [temp])]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    scale = model.logit_scale if temp is None else temp
    for w in range(WINDOWS):
        window = batches[w * STEPS:(w + 1) * STEPS]
        opt.zero_grad(set_to_none=True)
        win_weights = None if weights is None else weights[w * STEPS:(w + 1) * STEPS]
        full_batch_grads(model, [[b] for b in window], lambda i, t: clip_loss(i, t, scale), win_weights)
        opt.step()
    return [p.detach().clone() for p in params]


def counted(ddp: DDP) -> dict[str, int]:
    count = {"calls": 0}

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        count["calls"] += 1
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return count


def ddp_run(rank: int, world: int, *, rows: list[int] = EVEN, find_unused: bool = False,
            outside: bool = False, sync: str = "window", frozen: bool = False) -> dict[str, Any]:
    """``outside``: the temperature is a parameter of its own, not of the DDP module; ``frozen``:
    the text tower does not train (``requires_grad_(False)``), in the reference too."""
    towers = Towers()
    if frozen:
        towers.text.requires_grad_(False)
    base: nn.Module = Encoders(towers) if outside else towers
    model = copy.deepcopy(base)
    temperature = nn.Parameter(torch.tensor(0.7, dtype=torch.float64)) if outside else None
    initial = copy.deepcopy(temperature)
    ddp = DDP(model, find_unused_parameters=find_unused)
    count = counted(ddp)
    params = [*ddp.parameters(), *([] if temperature is None else [temperature])]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    acc = gradaccum.Accumulator(opt, STEPS, model=ddp, sync=sync)
    scale = model.logit_scale if temperature is None else temperature
    batches = global_batches(rows)
    calls, losses = [], []
    for batch in batches:
        if acc.backward_cached(lambda c: ddp(*c), lambda i, t: clip_loss(i, t, scale),
                               my_chunks(batch, rows, rank)):
            calls.append(count["calls"])
            losses.append(float(acc.window_loss))
    ref_scale = towers.logit_scale if initial is None else initial
    with torch.no_grad():
        first = sum(float(clip_loss(*base(*b), ref_scale)) for b in batches[:STEPS]) / STEPS
    return {"params": [p.detach().clone() for p in params], "want": reference(base, batches, initial),
            "calls": calls, "first_loss": losses[0], "ref_first_loss": first}


def n_items_run(rank: int, world: int, reduction: str) -> dict[str, Any]:
    """Global batches of different sizes, shared unequally; the window weighs each by its items."""
    base = Towers()
    ddp = DDP(copy.deepcopy(base))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    acc = gradaccum.Accumulator(opt, STEPS, model=ddp)
    shares = [[14, 10], [3, 9], [8, 8], [5, 11]]
    batches = [pairs(sum(rows), seed=30 + b) for b, rows in enumerate(shares)]
    scale = ddp.module.logit_scale
    summed = reduction == "sum"
    for batch, rows in zip(batches, shares, strict=True):
        acc.backward_cached(lambda c: ddp(*c),
                            lambda i, t: clip_loss(i, t, scale) * (len(i) if summed else 1),
                            my_chunks(batch, rows, rank), rows[rank], reduction=reduction)
    sizes = [sum(rows) for rows in shares]
    windows = [sizes[w * STEPS:(w + 1) * STEPS] for w in range(WINDOWS)]
    weights = [n / sum(window) for window in windows for n in window]
    return {"params": [p.detach().clone() for p in ddp.parameters()],
            "want": reference(base, batches, None, weights)}


def refusals(rank: int, world: int) -> dict[str, Any]:
    """Different chunk counts, and one rank's odd output: every rank raises, nothing changes."""
    model = DDP(Towers())
    acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), STEPS, model=model)
    loss = lambda i, t: clip_loss(i, t, model.module.logit_scale)  # noqa: E731
    batch = global_batches(EVEN)[0]
    acc.backward_cached(lambda c: model(*c), loss, my_chunks(batch, EVEN, rank))
    before = [p.grad.clone() for p in model.parameters()]
    out: dict[str, Any] = {}
    try:  # 3 chunks on rank 0, 1 on rank 1
        acc.backward_cached(lambda c: model(*c), loss, my_chunks(batch, EVEN, rank, 3 if rank == 0 else 1))
    except ValueError as e:
        out["counts"] = str(e)
    for name, odd in (("no_batch_dim", lambda t: t[0, 0]), ("per_example", lambda t: t[0]),
                      ("rows", lambda t: t[:1])):
        def encode(c: Any, odd: Any = odd) -> Any:
            i, t = model(*c)
            return (i, odd(t)) if rank == 1 else (i, t)

        try:
            acc.backward_cached(encode, loss, my_chunks(batch, EVEN, rank))
        except ValueError as e:
            out[name] = str(e)
    out["unchanged"] = all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before, strict=True))
    out["micro_step"] = acc.micro_step
    return out


def fsdp_run(rank: int, world: int, sync: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    base = Towers()
    model, temperature = sharded(base)
    params = [*model.parameters(), temperature]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    acc = gradaccum.Accumulator(opt, STEPS, model=model, sync=sync)
    batches = global_batches(UNEVEN, seed=50)
    for batch in batches:
        acc.backward_cached(lambda c: model(*c), lambda i, t: clip_loss(i, t, temperature),
                            my_chunks(batch, UNEVEN, rank))
    full = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in params]
    want = reference(base, batches)  # logit_scale first: a module's own parameters come first
    return {"params": full, "want": [*want[1:], want[0]]}


def failing(forward: Any, at: int) -> Any:
    """``encode`` through ``forward`` whose call ``at`` (from 0) raises."""
    calls = [0]

    def encode(chunk: Any) -> Any:
        calls[0] += 1
        if calls[0] - 1 == at:
            raise RuntimeError("encode failed")
        return forward(chunk)

    return encode


def failures_run(rank: int, world: int, wrapper: str, sync: str = "window") -> dict[str, Any]:
    """A call that raises in its second pass (after its first chunk's backward, every rank alike):
    on a window's first micro-batch it leaves nothing (under FSDP2 too, whose pending gradients
    it drops); later in a window it leaves the window partly accumulated, refused until
    ``discard()``, except under FSDP2 with ``sync="micro_batch"``, where the call's own gradients
    were still pending inside FSDP2 (dropped: the window goes on). The windows fed afterwards equal
    one process on their global batches."""
    from torch.distributed.tensor import DTensor

    base = Towers()
    if wrapper == "ddp":
        model: Any = DDP(copy.deepcopy(base))
        params, scale = list(model.parameters()), model.module.logit_scale
    else:
        model, scale = sharded(base)
        params = [*model.parameters(), scale]
    acc = gradaccum.Accumulator(torch.optim.SGD(params, lr=0.1, momentum=0.9), STEPS, model=model, sync=sync)
    batches = global_batches(EVEN, seed=70)
    mine = [my_chunks(b, EVEN, rank) for b in batches]

    def feed(chunks: list[Any], encode: Any = lambda c: model(*c)) -> bool:
        return acc.backward_cached(encode, lambda i, t: clip_loss(i, t, scale), chunks)

    out: dict[str, Any] = {}
    try:
        feed(mine[0], failing(lambda c: model(*c), CHUNKS + 1))
    except RuntimeError as e:
        out["first"] = str(e)
    out["left_nothing"] = acc.micro_step == 0 and all(p.grad is None for p in params)
    feed(mine[0])
    feed(mine[1])
    feed(mine[2])
    try:
        feed(mine[3], failing(lambda c: model(*c), CHUNKS + 1))
    except RuntimeError as e:
        out["later"] = str(e)
    try:
        feed(mine[3])
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
        acc.discard()
        feed(mine[2])
        feed(mine[3])
    out["steps"] = acc.optimizer_steps
    out["params"] = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in params]
    want = reference(base, batches)
    out["want"] = want if wrapper == "ddp" else [*want[1:], want[0]]
    return out


if __name__ == "__main__":
    run_scenarios({
        "ddp": lambda r, w: ddp_run(r, w),
        "ddp_find_unused": lambda r, w: ddp_run(r, w, find_unused=True),
        "ddp_outside": lambda r, w: ddp_run(r, w, outside=True),
        "ddp_uneven": lambda r, w: ddp_run(r, w, rows=UNEVEN),
        "ddp_micro_batch": lambda r, w: ddp_run(r, w, sync="micro_batch"),
        "ddp_frozen": lambda r, w: ddp_run(r, w, frozen=True),
        "n_items_mean": lambda r, w: n_items_run(r, w, "mean"),
        "n_items_sum": lambda r, w: n_items_run(r, w, "sum"),
        "refusals": refusals,
        "fsdp_window": lambda r, w: fsdp_run(r, w, "window"),
        "fsdp_micro_batch": lambda r, w: fsdp_run(r, w, "micro_batch"),
        "failures_ddp": lambda r, w: failures_run(r, w, "ddp"),
        "failures_fsdp": lambda r, w: failures_run(r, w, "fsdp"),
        "failures_fsdp_micro_batch": lambda r, w: failures_run(r, w, "fsdp", "micro_batch"),
    })
