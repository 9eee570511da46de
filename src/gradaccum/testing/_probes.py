"""The evidence for a first window that differs: the step run on several splits of the batch (1 to
4 micro-batches besides yours), each against every weighting of its micro-batches that a known
mistake gives (computed with your ``loss_fn``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gradaccum.testing._compare import flat
from gradaccum.testing._evidence import Probe, clip
from gradaccum.testing._runs import Job, Trace, build, grads_of, run_split
from gradaccum.torch.memory.split import batch_size, split_batch

__all__ = ["IGNORE_INDEX", "label_tensors", "make_probes", "probe_sizes"]

IGNORE_INDEX = -100  # the label PyTorch's and Hugging Face's token losses skip
LossFn = Callable[[nn.Module, Any], torch.Tensor]


def probe_sizes(total: int, splits: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Your splits, then even splits into 1, 2, 3 and 4 micro-batches (those the batch allows)."""
    out = list(dict.fromkeys(splits))
    for k in range(1, min(4, total) + 1):
        q, r = divmod(total, k)
        sizes = (q + 1,) * r + (q,) * (k - r)
        if sizes not in out:
            out.append(sizes)
    return out


def label_tensors(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """The batch's integer tensors with a sequence dimension (labels, token ids), by where they are."""
    if isinstance(batch, torch.Tensor):
        items: list[tuple[str, Any]] = [("batch", batch)]
    elif isinstance(batch, dict):
        items = [(f"batch[{k!r}]", v) for k, v in batch.items()]
    elif isinstance(batch, (tuple, list)):
        items = [(f"batch[{i}]", v) for i, v in enumerate(batch)]
    else:
        items = []
    return [(where, t) for where, t in items if isinstance(t, torch.Tensor) and t.dim() >= 2
            and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)]


def make_probes(job: Job, ref: Trace, known: dict[tuple[int, ...], Trace], loss_fn: LossFn | None,
                clip_norm: float | None) -> list[Probe]:
    """One :class:`Probe` per split the step stepped once on in its first window.

    Args:
        job: the run (its splits are the user's; the probes run on one process, one window).
        ref: the full-batch reference (its first window's gradient is the ``"full"`` weighting).
        known: first windows already run on one process, by split.
        loss_fn: gives the other weightings; without it only ``"full"`` is tried.
        clip_norm: the reference's clip norm.
    """
    if loss_fn is not None:
        full = flat(ref.pre_clip[0], list(job.names))
    elif len(ref.steps[0]) == 1:
        full = flat(ref.steps[0][0].grads, list(job.names))
    else:
        return []
    one = replace(job, world=1, windows=1)
    total = batch_size(job.batch)
    probes = []
    for sizes in probe_sizes(total, job.sizes if job.world == 1 else []):
        trace = known.get(sizes)
        if trace is None:
            try:
                trace = run_split(one, job.batch, sizes, 0, keep_error=True)
            except Exception:  # a step that cannot run this split (or off its ranks) adds no evidence
                continue
        if len(trace.steps[0]) != 1:
            continue
        seen = flat(trace.steps[0][0].grads, list(job.names))
        bases, each = {"full": full}, None
        if loss_fn is not None:
            more, each = _weightings(job, loss_fn, sizes, clip_norm)
            bases.update(more)
        probes.append(Probe(sizes, seen, bases, each))
    return probes


def _weightings(job: Job, loss_fn: LossFn, sizes: tuple[int, ...],
                clip_norm: float | None) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The micro-batches' gradients, weighted each way; and the sum clipped on every micro-batch."""
    names = list(job.names)
    grads = []
    for micro in split_batch(job.batch, list(sizes)):
        torch.manual_seed(job.seed)
        model = build(job)
        torch.autograd.backward(loss_fn(model, micro))
        grads.append(flat(grads_of(model), names))
    stacked = torch.stack(grads)
    out = {"means": stacked.mean(0)}
    for where, labels in label_tensors(job.batch):
        if not bool((labels == IGNORE_INDEX).any()):
            continue  # without padding a count is the rows' count times the length: no evidence of a shift
        for key, part in (("count", labels), ("shifted", labels[:, 1:])):
            parts = torch.split(part, list(sizes))
            counts = torch.stack([(c != IGNORE_INDEX).sum() for c in parts]).double()
            if float(counts.sum()) > 0:
                out[f"{key}:{where}"] = (counts[:, None] * stacked).sum(0) / counts.sum()
    each = None
    if clip_norm is not None:
        each = torch.zeros_like(stacked[0])
        for g in grads:
            each = clip(each + g / len(grads), clip_norm)
    return out, each
