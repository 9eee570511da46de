"""The evidence for a first window that differs: the step run on several splits of the batch (1 to
4 micro-batches besides yours), each against every weighting of its micro-batches that a known
mistake gives, and the micro-batches' own gradients (computed with your ``loss_fn``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gradaccum.testing._combination import solve
from gradaccum.testing._compare import flat
from gradaccum.testing._evidence import Probe, clip
from gradaccum.testing._moved import shrink
from gradaccum.testing._runs import Job, Trace, build, grads_of, run_split
from gradaccum.torch.memory.split import batch_size, split_batch

__all__ = ["IGNORE_INDEX", "batch_counts", "batch_tensors", "label_tensors", "make_probes", "probe_sizes"]

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


def batch_tensors(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """The batch's tensors, by where they are (``batch[1]``, ``batch['labels']``)."""
    if isinstance(batch, torch.Tensor):
        items: list[tuple[str, Any]] = [("batch", batch)]
    elif isinstance(batch, dict):
        items = [(f"batch[{k!r}]", v) for k, v in batch.items()]
    elif isinstance(batch, (tuple, list)):
        items = [(f"batch[{i}]", v) for i, v in enumerate(batch)]
    else:
        items = []
    return [(where, t) for where, t in items if isinstance(t, torch.Tensor)]


def label_tensors(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """The batch's integer tensors with a sequence dimension (labels, token ids), by where they are."""
    return [(where, t) for where, t in batch_tensors(batch) if t.dim() >= 2
            and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)]


def batch_counts(batch: Any) -> tuple[int, ...]:
    """The batch's own counts a loss may average over: each label tensor's tokens (those not
    ``IGNORE_INDEX``), before and after the shift, then its rows."""
    out = []
    for _, labels in label_tensors(batch):
        out += [int((labels != IGNORE_INDEX).sum()), int((labels[:, 1:] != IGNORE_INDEX).sum())]
    return (*out, batch_size(batch))


def make_probes(job: Job, ref: Trace, known: dict[tuple[int, ...], Trace], loss_fn: LossFn | None,
                clip_norm: float | None, tol: float = 1e-6) -> list[Probe]:
    """One :class:`Probe` per split the step stepped once on in its first window.

    Args:
        job: the run (its splits are the user's; the probes run on one process, one window).
        ref: the full-batch reference (its first window's gradient is the ``"full"`` weighting).
        known: first windows already run on one process, by split.
        loss_fn: gives the other weightings; without it only ``"full"`` is tried.
        clip_norm: the reference's clip norm.
        tol: how close a weighting must come to the full batch's gradient to be its own.
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
        bases: dict[str, torch.Tensor] = {"full": full}
        each: dict[str, torch.Tensor] = {}
        parts = None
        if loss_fn is not None:
            parts = _parts(job, loss_fn, sizes)
            weights = _weights(job, sizes, parts, full if clip_norm is not None else None, tol)
            bases.update({name: w @ parts for name, w in weights.items() if name != "full"})
            if clip_norm is not None:
                each = _clipped_each(parts, weights, clip_norm)
        probes.append(Probe(sizes, seen, bases, each, parts, trace.steps[0][0].lrs,
                            shrink(trace.starts[0], trace.steps[0][0].moved, tol * 1e-3)))
    return probes


def _parts(job: Job, loss_fn: LossFn, sizes: tuple[int, ...]) -> torch.Tensor:
    """Each micro-batch's own gradient (``loss_fn`` on it alone, from the start), one row each."""
    names = list(job.names)
    grads = []
    for micro in split_batch(job.batch, list(sizes)):
        torch.manual_seed(job.seed)
        model = build(job)
        torch.autograd.backward(loss_fn(model, micro))
        grads.append(flat(grads_of(model), names))
    return torch.stack(grads)


def _weights(job: Job, sizes: tuple[int, ...], parts: torch.Tensor | None = None,
             full: torch.Tensor | None = None, tol: float = 1e-6) -> dict[str, torch.Tensor]:
    """The micro-batches' weights (summing to 1) of each weighting a known mistake gives: ``"means"``
    (1/k each), ``"items"`` (by their rows), ``"count:<where>"`` and ``"shifted:<where>"`` (by a
    label tensor's tokens before and after the shift, where it holds padding); with ``full``, the
    ``"full"`` batch's own (read from its gradient when it is a weighting of ``parts``)."""
    k = len(sizes)
    out = {"means": torch.full((k,), 1.0 / k, dtype=torch.float64),
           "items": torch.tensor(sizes, dtype=torch.float64) / sum(sizes)}
    for where, labels in label_tensors(job.batch):
        if not bool((labels == IGNORE_INDEX).any()):
            continue  # without padding a count is the rows' count times the length: no evidence of a shift
        for key, part in (("count", labels), ("shifted", labels[:, 1:])):
            counts = torch.stack([(c != IGNORE_INDEX).sum() for c in torch.split(part, list(sizes))]).double()
            if float(counts.sum()) > 0:
                out[f"{key}:{where}"] = counts / counts.sum()
    if full is not None and parts is not None:
        found = solve(parts, full, tol)
        if found is not None:
            out["full"] = found
    return out


def _clipped_each(parts: torch.Tensor, weights: dict[str, torch.Tensor],
                  clip_norm: float) -> dict[str, torch.Tensor]:
    """For each weighting, its running sum clipped after every micro-batch (``name``), and the sum
    of its micro-batches' shares each clipped on its own (``own:name``)."""
    out = {}
    for name, w in weights.items():
        each = torch.zeros_like(parts[0])
        own = torch.zeros_like(parts[0])
        for weight, g in zip(w, parts, strict=True):
            each = clip(each + weight * g, clip_norm)
            own = own + clip(weight * g, clip_norm)
        out[name] = each
        out[f"own:{name}"] = own
    return out
