"""The pipeline tests' model, data and one-process reference (tests/distributed/pipeline_ranks.py).

A small token model, ``2 * S`` layers for ``S`` stages (an embedding, tanh blocks, a head), split
into stages of two layers each; padded labels (``PAD``) whose counts differ across pipeline
micro-batches, calls, windows and replicas. The reference trains the unsplit model on a window's
whole batch in one process: the summed token loss over the window's valid tokens, one backward,
the same clipping and optimizer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

VOCAB, HIDDEN, SEQ, PAD = 13, 8, 5, -100
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def full_model(n_stages: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Sequential:
    """``2 * n_stages`` layers: an embedding, tanh blocks and a linear head (seeded)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Embedding(VOCAB, HIDDEN)]
    layers += [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(2 * n_stages - 2)]
    layers.append(nn.Linear(HIDDEN, VOCAB))
    return nn.Sequential(*layers).to(dtype)


def stage_module(full: nn.Sequential, index: int) -> nn.Sequential:
    """Stage ``index``'s two layers (a copy)."""
    return copy.deepcopy(full[2 * index: 2 * index + 2])


def token_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy over a micro-batch's valid tokens."""
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=PAD,
                                       reduction="sum")


def token_mean(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over a micro-batch's valid tokens."""
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=PAD)


def count(target: torch.Tensor) -> torch.Tensor:
    """A micro-batch's valid tokens (what ``n_items`` is given)."""
    return (target != PAD).sum()


def batch(n_seqs: int, seed: int, dtype: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and padded labels; every row has at least one valid label, counts differ."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n_seqs, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (n_seqs,), generator=g)
    labels = torch.randint(0, VOCAB, (n_seqs, SEQ), generator=g)
    labels[torch.arange(SEQ) >= lengths[:, None]] = PAD
    return tokens, labels


def window_batches(window: int, steps: int, replicas: int, n_seqs: int) -> list[list[tuple[Any, Any]]]:
    """Every replica's batches of one window: ``[replica][call] -> (tokens, labels)``."""
    return [[batch(n_seqs, seed=1000 * window + 10 * r + c) for c in range(steps)] for r in range(replicas)]


def reference(n_stages: int, windows: Sequence[list[list[tuple[Any, Any]]]], make_opt: Callable[..., Any],
              clip: float | None, scheduler: Callable[..., Any] | None = None) -> tuple[nn.Sequential, list[float]]:
    """The unsplit model trained in one process, one step per window on its whole batch."""
    model = full_model(n_stages)
    opt = make_opt(model.parameters())
    sched = None if scheduler is None else scheduler(opt)
    losses = []
    for window in windows:
        tokens = torch.cat([t for replica in window for t, _ in replica])
        labels = torch.cat([y for replica in window for _, y in replica])
        opt.zero_grad(set_to_none=True)
        loss = token_sum(model(tokens), labels) / (labels != PAD).sum()
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss))
    return model, losses


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def layout(world: int, pp: int) -> tuple[Any, Any, int, int]:
    """``(pp_group, dp_mesh, pp_rank, dp_rank)`` for ``world`` ranks, pipelines of ``pp`` ranks
    (rank ``r``: replica ``r // pp``, pipeline position ``r % pp``), as torchtitan lays them out."""
    rank = dist.get_rank()
    if pp == world:
        return None, None, rank, 0
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // pp, pp), mesh_dim_names=("dp", "pp"))
    return mesh["pp"].get_group(), mesh["dp"], rank % pp, rank // pp


def build(kind: str, full: nn.Sequential, pp_rank: int, pp: int, n_mb: int, loss_fn: Any, *,
          virtual: int = 1, pp_group: Any = None, wrap: Callable[[nn.Module], nn.Module] | None = None,
          scale_grads: bool = False) -> tuple[Any, list[nn.Module]]:
    """This rank's stage module(s) and the schedule over them (``virtual`` stages per rank)."""
    n_stages = pp * virtual
    mods, stages = [], []
    for index in range(pp_rank, n_stages, pp):
        mod = stage_module(full, index)
        if wrap is not None:
            mod = wrap(mod)
        mods.append(mod)
        stages.append(PipelineStage(mod, index, n_stages, torch.device("cpu"), group=pp_group))
    cls = SCHEDULES[kind]
    schedule = cls(stages if virtual > 1 else stages[0], n_mb, loss_fn=loss_fn, scale_grads=scale_grads)
    return schedule, mods


def stage_params(full: nn.Sequential, pp_rank: int, pp: int, virtual: int = 1) -> list[torch.Tensor]:
    """The reference's parameters of this rank's stages, in the stage modules' order."""
    out = []
    for index in range(pp_rank, pp * virtual, pp):
        out += [p.detach().clone() for p in full[2 * index: 2 * index + 2].parameters()]
    return out


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (an FSDP2 shard gathered)."""
    gather = getattr(p, "full_tensor", None)
    return (p if gather is None else gather()).detach()


def max_diff(mods: Sequence[nn.Module], want: Sequence[torch.Tensor]) -> float:
    got = [full(p) for m in mods for p in m.parameters()]
    assert len(got) == len(want)
    return max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
