"""The words for a hypothesis that stands (:mod:`gradaccum.testing._evidence`): its name, said as a
count of the batch's own where its factor is one (tokens, rows, elements), and the sentence that
says what the probes showed."""

from __future__ import annotations

import math

from gradaccum.testing import _words as words
from gradaccum.testing._evidence import Hypothesis, Probe
from gradaccum.testing._probes import IGNORE_INDEX, batch_tensors, label_tensors
from gradaccum.testing._runs import Job
from gradaccum.torch.memory.split import batch_size

__all__ = ["evidence", "is_token_ratio", "loss_scale", "name"]


def name(h: Hypothesis, k: int, job: Job, tol: float) -> str:
    """What hypothesis ``h`` is called for a window of ``k`` micro-batches."""
    if h == Hypothesis("full", "exact"):  # it stands beside others only where clipping binds
        return words.HIDDEN_SCALE
    scale = {"twice": words.twice(k), "not divided": words.not_divided(k), "exact": "",
             "fixed": words.fixed_n(k, int(h.param)), "clip each": words.CLIP_EACH,
             "clip own": words.CLIP_OWN,
             "constant": _constant(h.param, job, tol)}[h.family]
    if h.base == "full":
        return scale
    weighting = {"means": words.MEANS, "items": words.ROWS}.get(h.base) or words.count_weights(h.base)
    return weighting + (f", and {scale}" if scale else "")


def _token_ratio(factor: float, job: Job, tol: float) -> tuple[str, int, int] | None:
    """The label tensor whose token count after the shift over that before it (or the inverse)
    is ``factor``: where it is, and the two counts."""
    for where, labels in label_tensors(job.batch):
        shifted = int((labels[:, 1:] != IGNORE_INDEX).sum())
        counted = int((labels != IGNORE_INDEX).sum())
        for a, b in ((shifted, counted), (counted, shifted)):
            if b and abs(factor - a / b) <= tol * factor:
                return where, a, b
    return None


def is_token_ratio(factor: float, job: Job, tol: float) -> bool:
    """Whether ``factor`` is a label tensor's ratio of tokens after and before the shift (or its inverse)."""
    return _token_ratio(factor, job, tol) is not None


def loss_scale(factor: float, tol: float, least: int = 8) -> int | None:
    """``m`` when ``factor`` is ``2**m`` or ``2**-m`` for ``least <= m <= 24``: a loss scale (a
    GradScaler's is a power of 2, 2**16 at the start); else None."""
    if factor <= 0:
        return None
    m = round(math.log2(factor))
    return m if least <= abs(m) <= 24 and abs(factor / 2.0 ** m - 1) <= 10 * tol else None


def _constant(factor: float, job: Job, tol: float) -> str:
    """A constant factor, named an unshifted token count when it is the batch's ratio of counts,
    and a count of rows when it is a label tensor's tokens per row."""
    found = _token_ratio(factor, job, tol)
    if found is not None:
        return words.wrong_count(factor, *found)
    for where, labels in label_tensors(job.batch):
        for tokens in (int((labels != IGNORE_INDEX).sum()), int((labels[:, 1:] != IGNORE_INDEX).sum())):
            if tokens != labels.shape[0] and abs(factor - tokens / labels.shape[0]) <= tol * factor:
                return words.rows_count(factor, where, tokens, labels.shape[0])
            if tokens > 1 and abs(factor - tokens) <= tol * factor:
                return words.never_divided(f"{tokens} tokens of {where}")
    rows = batch_size(job.batch)  # the probes' batch: the whole one, on one process
    if rows > 1 and abs(factor - rows) <= tol * factor:
        return words.never_divided(f"{rows} items of the batch")
    for where, tensor in batch_tensors(job.batch):  # a mean over elements (MSE's), never taken
        if tensor.numel() > 1 and abs(factor - tensor.numel()) <= tol * factor:
            return words.never_divided(f"{tensor.numel()} elements of {where}")
    m = loss_scale(factor, tol)
    if m is not None:
        return words.scale_left(m)
    return words.wrong_count(factor, None)


def evidence(h: Hypothesis, probes: list[Probe], clip_norm: float | None, scale_hidden: bool = False) -> str:
    """The sentence that says what the probes showed."""
    ordered = sorted(probes, key=lambda p: (len(p.sizes), p.sizes))
    ks = ", ".join(str(len(p.sizes)) for p in ordered)
    splits = ", ".join("+".join(map(str, p.sizes)) for p in ordered)
    rule = {"exact": "", "twice": " divided by k", "not divided": " times k",
            "fixed": f" times k/{int(h.param)}", "constant": f" times {h.param:.4g}",
            "clip each": "", "clip own": ""}[h.family]
    if h.base == "full":
        said = f"the full batch's gradient{rule}"
    elif h.base == "means":
        said = f"the mean of the micro-batches' own mean gradients{rule}"
    elif h.base == "items":
        said = f"the micro-batches' own mean gradients weighted by their rows{rule}"
    else:
        kind, where = h.base.split(":", 1)
        said = (f"the micro-batches' gradients weighted by {where}'s token counts "
                f"{'before' if kind == 'count' else 'after'} the shift{rule}")
    if h.family == "clip each":
        of = "" if h.base == "full" else " of " + said
        said = f"the running sum{of} clipped at {clip_norm:g} after every micro-batch"
    if h.family == "clip own":
        of = "the micro-batches' shares" if h.base == "full" else "the shares of " + said
        said = f"the sum of {of}, each clipped at {clip_norm:g} on its own"
    if scale_hidden:
        said = said.removesuffix(rule) + " at some scale"
    clipped = "" if clip_norm is None or h.family in ("clip each", "clip own") else \
        f", clipped at {clip_norm:g}"
    return (f"the window gradient is {said}{clipped}, for k = {ks} micro-batches ({splits}), and no "
            "other known mistake gives these gradients")
