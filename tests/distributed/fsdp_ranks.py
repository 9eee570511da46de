"""Rank side of tests/distributed/test_fsdp.py: FSDP2 (``fully_shard``) on CPU with gloo.

As in ddp_ranks.py, every rank computes the one-process full-batch reference itself.
Run as ``python -m tests.distributed.fsdp_ranks OUT`` under the torchrun environment (see
tests/ranks.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.functional import cross_entropy

import gradaccum
from tests.ranks import run_scenarios
from tests.reference import data, make_optimizer, mlp

STEPS, MICRO, WINDOWS, CLIP = 3, 4, 3, 0.2


def sharded(dtype: torch.dtype = torch.float64) -> nn.Module:
    model = mlp(dtype)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model


def full_params(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def share(x: torch.Tensor, y: torch.Tensor, rank: int, steps: int, micro: int) -> list[Any]:
    xs, ys = x.split(micro), y.split(micro)
    return [(xs[rank * steps + i], ys[rank * steps + i]) for i in range(steps)]


def reference(windows: list[Any], clip: float | None) -> dict[str, Any]:
    """Plain full-batch steps; the pre-clip gradient norm and the loss of each window."""
    model = mlp()
    opt = make_optimizer("adamw", model.parameters())
    norms, losses = [], []
    for x, y in windows:
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(float(loss.detach()))
    return {"ref_params": [p.detach().clone() for p in model.parameters()], "ref_norms": norms,
            "ref_losses": losses}


def windows_run(rank: int, world: int, sync: str) -> dict[str, Any]:
    model = sharded()
    acc = gradaccum.Accumulator(make_optimizer("adamw", model.parameters()), STEPS, model=model,
                                clip_norm=CLIP, sync=sync)
    held, norms, losses, windows = [], [], [], []
    for w in range(WINDOWS):
        x, y = data(world * STEPS * MICRO, seed=100 + w)
        windows.append((x, y))
        for xb, yb in share(x, y, rank, STEPS, MICRO):
            if not acc.backward(cross_entropy(model(xb), yb)):
                # Sharded gradients present mid-window: only when every backward reduce-scatters.
                held.append([p.grad is not None for p in model.parameters()])
        assert acc.grad_norm is not None and acc.window_loss is not None
        norms.append(acc.grad_norm)
        losses.append(float(acc.window_loss))
    return {"params": full_params(model), "held": held, "norm_types": [type(n).__name__ for n in norms],
            "norms": [float(n) for n in norms], "losses": losses, "world_size": acc.world_size,
            **reference(windows, CLIP)}


def flush_partial(rank: int, world: int, sync: str) -> dict[str, Any]:
    """A 2-of-4 mean window and an item-weighted 2-of-4 window with uneven sizes, both flushed,
    then a flush of an empty window."""
    model = sharded()
    acc = gradaccum.Accumulator(make_optimizer("adamw", model.parameters()), 4, model=model,
                                clip_norm=CLIP, sync=sync)
    x, y = data(world * 2 * MICRO, seed=400)
    windows = [(x, y)]
    for xb, yb in share(x, y, rank, 2, MICRO):
        acc.backward(cross_entropy(model(xb), yb))
    flushed = [acc.flush()]
    sizes = [[3, 1], [2, 5]]
    x, y = data(11, seed=450)
    windows.append((x, y))
    xr, yr = x.split([4, 7])[rank], y.split([4, 7])[rank]
    for xb, yb in zip(xr.split(sizes[rank]), yr.split(sizes[rank]), strict=True):
        acc.backward(cross_entropy(model(xb), yb), n_items=torch.tensor(len(yb)))
    flushed.append(acc.flush())
    flushed.append(acc.flush())
    return {"params": full_params(model), "flushed": flushed, **reference(windows, CLIP)}


def checkpoint_and_discard(rank: int, world: int) -> dict[str, Any]:
    """state_dict() mid-window is refused under window sync, whose partial grads FSDP2 keeps;
    discard() drops them, so the next window is exactly its own full batch."""
    x, y = data(world * 2 * MICRO, seed=800)
    out: dict[str, Any] = {}
    for sync in ("window", "micro_batch"):
        model = sharded()
        acc = gradaccum.Accumulator(make_optimizer("adamw", model.parameters()), 2, model=model,
                                    sync=sync)
        acc.state_dict()  # an empty window saves anywhere
        acc.backward(cross_entropy(model(x[:MICRO] * 3), y[:MICRO]))
        try:
            acc.state_dict()
            out[sync] = ""
        except RuntimeError as e:
            out[sync] = str(e)
        acc.discard()
        for xb, yb in share(x, y, rank, 2, MICRO):
            acc.backward(cross_entropy(model(xb), yb))
        out[f"{sync}_params"] = full_params(model)
    return out | reference([(x, y)], None)


def edited_grads(rank: int, world: int) -> dict[str, Any]:
    """A sharded gradient cleared before a window's last micro-batch: refused under "micro_batch"
    (the sharded .grad is the window's); under "window" FSDP2 holds the window's gradients and
    .grad is None mid-window: nothing to clear, nothing refused, the window exact."""
    out: dict[str, Any] = {}
    for sync in ("window", "micro_batch"):
        model = sharded()
        opt = make_optimizer("adamw", model.parameters())
        acc = gradaccum.Accumulator(opt, STEPS, model=model, sync=sync)
        x, y = data(world * STEPS * MICRO, seed=700)
        fed = share(x, y, rank, STEPS, MICRO)
        for xb, yb in fed[:-1]:
            acc.backward(cross_entropy(model(xb), yb))
        model[2].bias.grad = None
        try:
            acc.backward(cross_entropy(model(fed[-1][0]), fed[-1][1]))
            out[sync] = f"stepped: {acc.optimizer_steps}"
        except RuntimeError as e:
            out[sync] = str(e)
            acc.discard()
        out[f"{sync}_params"] = full_params(model)
    return out | reference([(x, y)], None)


def unsharded_root(rank: int, world: int) -> dict[str, Any]:
    model = mlp()
    fully_shard(model[0])
    try:
        gradaccum.Accumulator(make_optimizer("sgd", model.parameters()), 2, model=model)
    except ValueError as e:
        return {"message": str(e)}
    return {"message": ""}


if __name__ == "__main__":
    run_scenarios({
        "window": lambda r, w: windows_run(r, w, "window"),
        "micro_batch": lambda r, w: windows_run(r, w, "micro_batch"),
        "flush_window": lambda r, w: flush_partial(r, w, "window"),
        "flush_micro_batch": lambda r, w: flush_partial(r, w, "micro_batch"),
        "checkpoint_and_discard": checkpoint_and_discard,
        "unsharded_root": unsharded_root,
        "edited_grads": edited_grads,
    })
