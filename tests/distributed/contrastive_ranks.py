"""Rank side of tests/distributed/test_contrastive_ddp.py: the tiled losses of gradaccum.contrastive
as loss_fn of backward_cached under DDP and FSDP2 (gloo, CPU, 2 or 4 ranks), each rank computing
only its share of the rows.

Every rank trains on its share of each global batch of ``N`` rows (ranks hold different numbers,
two chunks each) and computes the one-process reference itself: the dense formula on the whole
global batch, one SGD step per clipped window. The ``counts`` scenarios run a loss alone on
gathered tensors under the ranks' context and count what each rank computes and sends.
Run as ``python -m tests.distributed.contrastive_ranks OUT`` under the torchrun environment.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import normalize
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import gradaccum
from gradaccum.contrastive import clip_loss, info_nce, rank_local, siglip_loss
from gradaccum.torch.cached.loss_ranks import ranks_running_loss
from gradaccum.torch.distributed.collectives import RankGroups
from tests.contrastive import Encoders, Towers, sharded, supcon_loss
from tests.contrastive_dense import clip_dense, info_nce_dense, siglip_dense
from tests.ranks import run_scenarios

N, STEPS, WINDOWS, TILE, CLIP_NORM = 24, 2, 2, 5, 0.05
ROWS = {2: [14, 10], 4: [7, 5, 6, 6]}  # rows per rank of a global batch of N


def data(seed: int, negatives: bool = False) -> tuple[torch.Tensor, ...]:
    """One global batch: images, texts (and texts of hard negatives), float64."""
    g = torch.Generator().manual_seed(seed)
    widths = [5, 6, 6] if negatives else [5, 6]
    return tuple(torch.randn(N, w, generator=g, dtype=torch.float64) for w in widths)


def mine(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> list[Any]:
    """This rank's rows of ``batch`` in two chunks."""
    rows = ROWS[world]
    start, count = sum(rows[:rank]), rows[rank]
    return gradaccum.chunks(tuple(t[start:start + count] for t in batch), -(-count // 2))


class WithScale(Encoders):
    """The encoders and a learnable temperature inside the DDP module (OpenCLIP's shape)."""

    def __init__(self, towers: Towers) -> None:
        super().__init__(towers)
        self.logit_scale = nn.Parameter(towers.logit_scale.detach().clone())


Encode = Callable[..., Any]


def train(model: nn.Module, wrapped: nn.Module, extra: list[nn.Parameter], loss: Callable[..., torch.Tensor],
          batches: list[tuple[torch.Tensor, ...]], rank: int, world: int,
          encode: Encode | None = None) -> dict[str, Any]:
    """backward_cached over this rank's chunks of each batch, ``STEPS`` per clipped window
    (``encode``: of a chunk's tensors, default ``wrapped(*chunk)``)."""
    params = [*model.parameters(), *extra]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    acc = gradaccum.Accumulator(opt, STEPS, model=wrapped, clip_norm=CLIP_NORM)
    run = wrapped if encode is None else encode
    losses = []
    for batch in batches:
        if acc.backward_cached(lambda c: run(*c), loss, mine(batch, rank, world)):
            losses.append(float(acc.window_loss))
    return {"params": [p.detach().clone() for p in params], "losses": losses}


def reference(model: nn.Module, extra: list[nn.Parameter], loss: Callable[..., torch.Tensor],
              batches: list[tuple[torch.Tensor, ...]], encode: Encode | None = None) -> dict[str, Any]:
    """One process: the dense loss of each whole global batch, the window's mean, clipped, one step."""
    params = [*model.parameters(), *extra]
    run = model if encode is None else encode
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    losses = []
    for w in range(WINDOWS):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for batch in batches[w * STEPS:(w + 1) * STEPS]:
            value = loss(*run(*batch)) / STEPS
            value.backward()
            total += float(value)
        nn.utils.clip_grad_norm_(params, CLIP_NORM)
        opt.step()
        losses.append(total)
    return {"params": [p.detach().clone() for p in params], "losses": losses}


def compare(make: Callable[[], tuple[nn.Module, list[nn.Parameter]]], tiled: Callable[..., Any],
            dense: Callable[..., Any], rank: int, world: int, negatives: bool = False) -> dict[str, Any]:
    """``tiled`` through backward_cached on the ranks against ``dense`` on one process.

    ``make()`` gives a fresh model and its parameters outside it; ``tiled(model, extra)`` and
    ``dense(model, extra)`` give the loss functions.
    """
    batches = [data(100 + b, negatives) for b in range(STEPS * WINDOWS)]
    model, extra = make()
    ref_model, ref_extra = make()
    wrapped = DDP(model)
    got = train(model, wrapped, extra, tiled(model, extra), batches, rank, world)
    want = reference(ref_model, ref_extra, dense(ref_model, ref_extra), batches)
    return {"got": got, "want": want}


class Work(TorchDispatchMode):
    """Multiply-adds of every matrix product, and the most elements of any tensor an op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.macs, self.largest = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default):
            x, y = args[-2], args[-1]
            self.macs += x.shape[0] * x.shape[1] * y.shape[1]
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def unit(z: torch.Tensor) -> torch.Tensor:
    return normalize(z, dim=1)


def clip_scenario(rank: int, world: int) -> dict[str, Any]:
    """CLIP; each call's forward multiply-adds in loss_fn are counted (this rank's rows only)."""
    macs: list[int] = []

    def make() -> tuple[nn.Module, list[nn.Parameter]]:
        return WithScale(Towers()), []

    def tiled(m: nn.Module, _: Any) -> Callable[..., torch.Tensor]:
        def loss(i: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            with Work() as work:
                value = clip_loss(unit(i), unit(t), m.logit_scale.exp(), tile=TILE)
            macs.append(work.macs)
            return value
        return loss

    def dense(m: nn.Module, _: Any) -> Callable[..., torch.Tensor]:
        return lambda i, t: clip_dense(unit(i), unit(t), m.logit_scale.exp())

    return {**compare(make, tiled, dense, rank, world), "forward_macs": macs}


def info_nce_scenario(rank: int, world: int) -> dict[str, Any]:
    """Hard negatives: the keys are the positives then the negatives, concatenated in loss_fn (their
    rows are not in rank order: the ranks' sum of the key gradients must still be exact)."""
    def make() -> tuple[nn.Module, list[nn.Parameter]]:
        return WithScale(Towers()), []

    def tiled(m: nn.Module, _: Any) -> Callable[..., torch.Tensor]:
        return lambda q, k, n: info_nce(unit(q), unit(torch.cat([k, n])), m.logit_scale.exp() * 3, tile=TILE)

    def dense(m: nn.Module, _: Any) -> Callable[..., torch.Tensor]:
        return lambda q, k, n: info_nce_dense(unit(q), unit(torch.cat([k, n])), m.logit_scale.exp() * 3)

    return compare(make, tiled, dense, rank, world, negatives=True)


def siglip_scenario(rank: int, world: int) -> dict[str, Any]:
    """SigLIP with its scale and bias learnable, outside the DDP module (gradaccum averages them)."""
    def make() -> tuple[nn.Module, list[nn.Parameter]]:
        scale = nn.Parameter(torch.tensor(math.log(10.0), dtype=torch.float64))
        return Encoders(Towers()), [scale, nn.Parameter(torch.tensor(-10.0, dtype=torch.float64))]

    return compare(make, lambda _, e: lambda i, t: siglip_loss(unit(i), unit(t), e[0].exp(), e[1], tile=TILE),
                   lambda _, e: lambda i, t: siglip_dense(unit(i), unit(t), e[0].exp(), e[1]), rank, world)


def supcon_rows(part: slice, z: torch.Tensor, labels: torch.Tensor,
                temperature: torch.Tensor) -> torch.Tensor:
    """SupCon's terms of the anchors in ``part``, summed (as tests.contrastive.supcon_loss)."""
    z = normalize(z, dim=1)
    anchors = torch.arange(len(z))[part]
    self_mask = anchors[:, None] == torch.arange(len(z))[None, :]
    logits = (z[part] @ z.T / temperature).masked_fill(self_mask, float("-inf"))
    log_prob = logits - logits.logsumexp(1, keepdim=True)
    positives = (labels[part][:, None] == labels[None, :]) & ~self_mask
    return -(log_prob.masked_fill(~positives, 0).sum(1) / positives.sum(1).clamp(min=1)).sum()


def rank_local_scenario(rank: int, world: int) -> dict[str, Any]:
    """A loss of one's own through rank_local: SupCon with a learnable temperature and labels."""
    batches = [(data(200 + b)[0], torch.arange(N) % 5) for b in range(STEPS * WINDOWS)]

    def make() -> tuple[nn.Module, list[nn.Parameter]]:
        return copy.deepcopy(Towers().image), [nn.Parameter(torch.tensor(0.5, dtype=torch.float64))]

    model, extra = make()
    ref_model, ref_extra = make()
    wrapped = DDP(model)
    temperature = extra[0]

    def tiled(z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return rank_local(supcon_rows, len(z), z, labels, temperature) / len(z)

    got = train(model, wrapped, extra, tiled, batches, rank, world, encode=lambda x, y: (wrapped(x), y))
    want = reference(ref_model, ref_extra, lambda z, y: supcon_loss(z, y, ref_extra[0]), batches,
                     encode=lambda x, y: (ref_model(x), y))
    return {"got": got, "want": want}


def fsdp_scenario(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    towers = Towers()
    (model, scale), ref = sharded(towers), Encoders(towers)
    ref_scale = nn.Parameter(towers.logit_scale.detach().clone())
    batches = [data(300 + b) for b in range(STEPS * WINDOWS)]
    got = train(model, model, [scale], lambda i, t: clip_loss(unit(i), unit(t), scale.exp(), tile=TILE),
                batches, rank, world)
    got["params"] = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                     for p in [*model.parameters(), scale]]
    want = reference(ref, [ref_scale], lambda i, t: clip_dense(unit(i), unit(t), ref_scale.exp()), batches)
    return {"got": got, "want": want}


# ---------------------------------------------------------------- what each rank computes and sends

LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "clip": lambda a, b, s, t: clip_loss(a, b, s, tile=TILE),
    "info_nce": lambda a, b, s, t: info_nce(a, b, s, tile=TILE),
    "siglip": lambda a, b, s, t: siglip_loss(a, b, s, t, tile=TILE),
    "rank_local": lambda a, b, s, t: rank_local(lambda p, a, b, s: (s * a[p] @ b.T).logsumexp(1).sum(),
                                                len(a), a, b, s),
}
DENSE: dict[str, Callable[..., torch.Tensor]] = {
    "clip": lambda a, b, s, t: clip_dense(a, b, s),
    "info_nce": lambda a, b, s, t: info_nce_dense(a, b, s),
    "siglip": siglip_dense,
    "rank_local": lambda a, b, s, t: (s * a @ b.T).logsumexp(1).sum(),
}


def counts(rank: int, world: int, name: str, rows: int = 40, dim: int = 3) -> dict[str, Any]:
    """The loss alone on the same (gathered) tensors on every rank, under the ranks' context: each
    rank's collectives, multiply-adds and largest tensor, and its gradients against the dense ones
    (info_nce: 12 keys more than queries)."""
    keys = rows + 12 if name == "info_nce" else rows
    g = torch.Generator().manual_seed(7)
    a = torch.randn(rows, dim, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(keys, dim, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    t = torch.tensor(-1.0, dtype=torch.float64, requires_grad=True)
    wrt = [a, b, s, t] if name == "siglip" else [a, b, s]
    sent: list[tuple[str, int]] = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, **kw: Any) -> Any:
        sent.append((str(op).rsplit(".", 1)[-1], tensor.numel()))
        return real(tensor, op=op, **kw)

    ranks = RankGroups([dist.group.WORLD], torch.device("cpu"), "window")
    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        with Work() as work:
            with ranks_running_loss(ranks):
                loss = LOSSES[name](a, b, s, t)
            forward = len(sent)
            grads = torch.autograd.grad(loss, wrt)
    finally:
        dist.all_reduce = real
    dense = DENSE[name](a, b, s, t)
    want = torch.autograd.grad(dense, wrt)
    return {"loss": float(loss), "dense": float(dense), "grads": [x.detach() for x in grads],
            "want": [x.detach() for x in want], "forward": sent[:forward], "backward": sent[forward:],
            "macs": work.macs, "largest": work.largest}


if __name__ == "__main__":
    run_scenarios({
        "clip": clip_scenario,
        "info_nce": info_nce_scenario,
        "siglip": siglip_scenario,
        "rank_local": rank_local_scenario,
        "fsdp": fsdp_scenario,
        **{f"counts_{name}": (lambda r, w, name=name: counts(r, w, name)) for name in LOSSES},
    })
