"""Pipeline parallelism on CPU: a token model split into stages, its reference, and four PP loops.

Shared by ``benchmarks/pipeline.py`` (time, aten ops and all-reduces per window; torchtitan's two
bugs measured) and the multi-process tests (tests/distributed/pipeline_ranks.py). The model has
``2 * S`` layers for ``S`` stages (an embedding, tanh blocks, a head), two layers per stage; the
labels carry padding (``PAD``) so counts differ across pipeline micro-batches, batches, windows
and replicas. The reference trains the unsplit model in one process on each window's whole batch:
the summed token loss over the window's valid tokens, one backward, clipping, one step.

The loops (:data:`LOOPS`, one window per call of :meth:`PipelineLoop.window`), each built on the
same stage modules and schedule kind, ``reduction="sum"`` losses:

- ``hand``: correct by hand, ``scale_grads=False``, the loss divided by the window's token total
  (known up front: every rank sees the labels), the clip norm all-reduced over the stages;
- ``titan1733``: the same with the schedule's default ``scale_grads=True`` (torchtitan #1733: each
  ``step()`` divides the gradients already accumulated by ``n_microbatches``);
- ``titan2972``: the raw summed loss backpropagated, divided by the token total only afterwards,
  for the logged loss (torchtitan #2972: gradients ``T`` times too large);
- ``gradaccum``: ``Accumulator.backward_pipeline(..., n_items=count, reduction="sum")``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import get_total_norm

import gradaccum

__all__ = ["LOOPS", "PAD", "SCHEDULES", "PipelineLoop", "batch", "build", "count", "full_model", "layout",
           "max_diff", "reference", "sgd", "stage_indices", "stage_params", "token_mean", "token_sum",
           "window_batches"]

VOCAB, HIDDEN, SEQ, PAD = 13, 8, 5, -100
LOOPS = ("hand", "titan1733", "titan2972", "gradaccum")
# The schedules the tests run, by short name (torch.distributed.pipelining's classes).
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
             "loopedbfs": "ScheduleLoopedBFS", "zb": "ScheduleInterleavedZeroBubble"}


def full_model(n_stages: int, dtype: torch.dtype = torch.float64, *, hidden: int = HIDDEN,
               vocab: int = VOCAB, seed: int = 0) -> nn.Sequential:
    """``2 * n_stages`` layers: an embedding, tanh blocks and a linear head (seeded)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Embedding(vocab, hidden)]
    layers += [nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(2 * n_stages - 2)]
    layers.append(nn.Linear(hidden, vocab))
    return nn.Sequential(*layers).to(dtype)


def token_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy over a micro-batch's valid tokens."""
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=PAD,
                                       reduction="sum")


def token_mean(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over a micro-batch's valid tokens."""
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=PAD)


def count(target: torch.Tensor) -> torch.Tensor:
    """A micro-batch's valid tokens: what ``n_items`` is given, per pipeline micro-batch."""
    return (target != PAD).sum()


def batch(n_seqs: int, seed: int, *, seq: int = SEQ, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and padded labels: every row has at least one valid label, lengths differ."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n_seqs, seq), generator=g)
    lengths = torch.randint(1, seq + 1, (n_seqs,), generator=g)
    labels = torch.randint(0, vocab, (n_seqs, seq), generator=g)
    labels[torch.arange(seq) >= lengths[:, None]] = PAD
    return tokens, labels


def window_batches(window: int, steps: int, replicas: int, n_seqs: int, **shape: int) -> list[list[Any]]:
    """Every replica's batches of one window: ``[replica][call] -> (tokens, labels)``."""
    return [[batch(n_seqs, seed=1000 * window + 10 * r + c, **shape) for c in range(steps)]
            for r in range(replicas)]


def sgd(params: Any) -> torch.optim.Optimizer:
    """The tests' optimizer: SGD with momentum, so an error carries into later windows."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(n_stages: int, windows: Sequence[list[list[Any]]], make_opt: Callable[..., Any],
              clip: float | None, scheduler: Callable[..., Any] | None = None,
              chunks: int | None = None) -> tuple[nn.Sequential, list[float]]:
    """The unsplit model trained in one process, one step per window on its whole batch: the mean
    over the window's valid tokens, or with ``chunks`` the mean of each batch's ``chunks`` pipeline
    micro-batches' token means (the window of ``backward_pipeline`` without ``n_items``)."""
    model = full_model(n_stages)
    opt = make_opt(model.parameters())
    sched = None if scheduler is None else scheduler(opt)
    losses = []
    for window in windows:
        opt.zero_grad(set_to_none=True)
        if chunks is None:
            tokens = torch.cat([t for replica in window for t, _ in replica])
            labels = torch.cat([y for replica in window for _, y in replica])
            loss = token_sum(model(tokens), labels) / (labels != PAD).sum()
        else:
            loss = torch.stack([token_mean(model(t), y) for replica in window for tokens, labels in replica
                                for t, y in zip(tokens.tensor_split(chunks), labels.tensor_split(chunks),
                                                strict=True)]).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    return model, losses


def layout(world: int, pp: int) -> tuple[Any, Any, int, int]:
    """``(pp_group, dp_mesh, pp_rank, dp_rank)`` for ``world`` ranks in pipelines of ``pp`` ranks
    (rank ``r``: replica ``r // pp``, position ``r % pp``), as torchtitan's mesh lays them out."""
    rank = dist.get_rank()
    if pp == world:
        return None, None, rank, 0
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // pp, pp), mesh_dim_names=("dp", "pp"))
    return mesh["pp"].get_group(), mesh["dp"], rank % pp, rank // pp


def build(kind: str, full: nn.Sequential, pp_rank: int, pp: int, n_mb: int, loss_fn: Any, *,
          virtual: int = 1, pp_group: Any = None, wrap: Callable[[nn.Module], nn.Module] | None = None,
          scale_grads: bool = False) -> tuple[Any, list[nn.Module]]:
    """This rank's stage modules (copies of ``full``'s layers) and a schedule over them.

    Args:
        kind: a key of :data:`SCHEDULES`; a multi-stage one takes ``virtual`` stages per rank
            (round robin: rank ``r`` holds stages ``r``, ``r + pp``, ...).
    """
    from torch.distributed.pipelining import PipelineStage

    n_stages = pp * virtual
    mods, stages = [], []
    for index in stage_indices(pp_rank, pp, virtual):
        mod: nn.Module = copy.deepcopy(full[2 * index: 2 * index + 2])
        if wrap is not None:
            mod = wrap(mod)
        mods.append(mod)
        stages.append(PipelineStage(mod, index, n_stages, torch.device("cpu"), group=pp_group))
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, SCHEDULES[kind])
    schedule = cls(stages if virtual > 1 else stages[0], n_mb, loss_fn=loss_fn, scale_grads=scale_grads)
    return schedule, mods


def stage_indices(pp_rank: int, pp: int, virtual: int = 1) -> list[int]:
    """The stages rank ``pp_rank`` holds (round robin)."""
    return list(range(pp_rank, pp * virtual, pp))


def stage_params(full: nn.Sequential, pp_rank: int, pp: int, virtual: int = 1) -> list[torch.Tensor]:
    """The reference's parameters of this rank's stages, in the stage modules' order."""
    return [p.detach().clone() for index in stage_indices(pp_rank, pp, virtual)
            for p in full[2 * index: 2 * index + 2].parameters()]


def max_diff(mods: Sequence[nn.Module], want: Sequence[torch.Tensor]) -> float:
    """The largest absolute difference of the stage modules' parameters from ``want``."""
    got = [_whole(p) for m in mods for p in m.parameters()]
    return max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))


def _whole(p: torch.Tensor) -> torch.Tensor:
    gather = getattr(p, "full_tensor", None)  # an FSDP2 shard
    return (p if gather is None else gather()).detach()


class PipelineLoop:
    """One of :data:`LOOPS` on this rank: 2 stages on 2 ranks, its own stage module and schedule.

    Args:
        loop: the loop's name.
        full: the unsplit model (copied).
        n_mb: pipeline micro-batches per ``step()``.
        steps: ``step()`` calls per window.
        clip: the clipping threshold, or None.
    """

    def __init__(self, loop: str, full: nn.Sequential, n_mb: int, steps: int, clip: float | None) -> None:
        self.loop, self.clip, self.rank = loop, clip, dist.get_rank()
        self.first, self.last = self.rank == 0, self.rank == dist.get_world_size() - 1
        self.total = torch.ones((), dtype=torch.float64)  # the window's token total (hand loops)
        loss_fn = token_sum if loop in ("titan2972", "gradaccum") else self._divided
        self.schedule, (self.mod,) = build("1f1b", full, self.rank, dist.get_world_size(), n_mb, loss_fn,
                                           scale_grads=loop == "titan1733")
        self.opt = sgd(self.mod.parameters())
        self.acc = gradaccum.Accumulator(self.opt, steps, model=self.mod, clip_norm=clip) \
            if loop == "gradaccum" else None

    def _divided(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return token_sum(output, target) / self.total

    def window(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Train one window on ``batches`` (``(tokens, labels)`` per ``step()``)."""
        if self.acc is not None:
            for tokens, labels in batches:
                self.acc.backward_pipeline(self.schedule, *((tokens,) if self.first else ()),
                                           target=labels if self.last else None,
                                           n_items=count if self.last else None, reduction="sum")
            return
        self.total = sum(((y != PAD).sum() for _, y in batches), torch.zeros((), dtype=torch.int64))
        for tokens, labels in batches:
            self.schedule.step(*((tokens,) if self.first else ()), target=labels if self.last else None)
        if self.clip is not None:
            grads = [p.grad for p in self.mod.parameters() if p.grad is not None]
            squared = get_total_norm(grads, foreach=True).square()
            dist.all_reduce(squared)  # the norm over every stage's gradients
            coef = torch.clamp(self.clip / (squared.sqrt() + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
