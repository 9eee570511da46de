"""One split's runs against the full batch's, window by window: where they part, and by how much."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradaccum.testing._runs import Trace

__all__ = ["Compared", "compare", "flat"]


@dataclass(frozen=True)
class Compared:
    """A split against the reference.

    Attributes:
        sizes: the micro-batch sizes (per rank).
        window: the first window (0-based) whose parameters differ; None when none does.
        max_abs: the largest parameter difference in that window (over every window when none).
        ratio, cosine: that window's update against the reference's (norm ratio, cosine).
        apart: how far the ranks ended apart in that window, when beyond the tolerance.
        traces: the runs, one per rank.
        stopped: the window whose step raised (0-based; the run stopped there), or None.
    """

    sizes: tuple[int, ...]
    window: int | None
    max_abs: float
    ratio: float
    cosine: float
    apart: float | None
    traces: list[Trace]
    stopped: int | None


def flat(tensors: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """The named tensors as one float64 vector, in ``names``'s order."""
    if not names:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([tensors[n].double().flatten() for n in names])


def compare(sizes: tuple[int, ...], traces: list[Trace], ref: Trace, start: dict[str, torch.Tensor],
            atol: float, rtol: float) -> Compared:
    """Compare every window's parameters, each within ``atol + rtol * (its largest reference move)``."""
    names = list(start)
    scale = {n: max((float((p[n] - start[n]).abs().max()) if start[n].numel() else 0.0)
                    for p in ref.params) for n in names}
    done = min(len(t.params) for t in traces)
    stopped = None if done == len(ref.params) else done
    worst_all = 0.0
    for w in range(done):
        worst, bad = 0.0, False
        for n in names:
            if not start[n].numel():
                continue
            diff = max(float((t.params[w][n] - ref.params[w][n]).abs().max()) for t in traces)
            worst, bad = max(worst, diff), bad or diff > atol + rtol * scale[n]
        worst_all = max(worst_all, worst)
        if bad:
            ratio, cosine = _update(traces[0], ref, start, w, names)
            return Compared(sizes, w, worst, ratio, cosine, _apart(traces, w, names, atol, rtol, scale),
                            traces, stopped)
    ratio, cosine = _update(traces[0], ref, start, done - 1, names, whole=True) if done else (1.0, 1.0)
    return Compared(sizes, None, worst_all, ratio, cosine, None, traces, stopped)


def _update(trace: Trace, ref: Trace, start: dict[str, torch.Tensor], w: int, names: list[str],
            whole: bool = False) -> tuple[float, float]:
    """Window ``w``'s update (the run's whole move with ``whole``) against the reference's."""
    before = start if whole or w == 0 else trace.params[w - 1]
    ref_before = start if whole or w == 0 else ref.params[w - 1]
    mine = flat(trace.params[w], names) - flat(before, names)
    theirs = flat(ref.params[w], names) - flat(ref_before, names)
    a, b = float(mine.norm()), float(theirs.norm())
    ratio = a / b if b > 0 else (1.0 if a == 0 else math.inf)
    cosine = float(mine @ theirs) / (a * b) if a > 0 and b > 0 else 1.0
    return ratio, cosine


def _apart(traces: list[Trace], w: int, names: list[str], atol: float, rtol: float,
           scale: dict[str, float]) -> float | None:
    """How far the ranks' parameters are apart after window ``w``, when beyond the tolerance."""
    if len(traces) < 2:
        return None
    apart = max((float((t.params[w][n] - traces[0].params[w][n]).abs().max())
                 for t in traces[1:] for n in names if traces[0].params[w][n].numel()), default=0.0)
    return apart if apart > atol + rtol * max(scale.values(), default=0.0) else None
