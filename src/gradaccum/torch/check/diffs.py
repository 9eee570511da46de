"""How far the accumulated runs ended from the full batch's, per parameter and buffer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from gradaccum.torch.check.report import TensorDiff

__all__ = ["buffer_diffs", "changed_buffers", "max_abs", "param_diffs", "scale", "spread"]

State = Mapping[str, torch.Tensor]


def scale(t: torch.Tensor) -> float:
    """The largest absolute value of ``t`` (0 for an empty tensor)."""
    return float(t.detach().double().abs().max()) if t.numel() else 0.0


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference of two tensors of one shape (in float64)."""
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max())


def param_diffs(base: nn.Module, full: nn.Module, runs: Sequence[State], atol: float,
                rtol: float) -> list[TensorDiff]:
    """One row per parameter: the worst of ``runs`` (one state per rank) against ``full``.

    The scale is the parameter's largest update in the full-batch run.
    """
    rows = []
    for (name, p0), pf in zip(base.named_parameters(), full.parameters(), strict=True):
        update = max_abs(pf, p0)
        diff = max(max_abs(pf, run[name]) for run in runs)
        rows.append(TensorDiff(name, "param", tuple(p0.shape), diff, _rel(diff, update),
                               diff <= atol + rtol * update, updated=update > 0 or diff > 0))
    return rows


def buffer_diffs(full: nn.Module, runs: Sequence[State], atol: float, rtol: float) -> list[TensorDiff]:
    """One row per buffer: the worst of ``runs`` against ``full``, relative to its largest value."""
    rows = []
    for name, bf in full.named_buffers():
        size = scale(bf)
        diff = max(max_abs(bf, run[name]) for run in runs)
        rows.append(TensorDiff(name, "buffer", tuple(bf.shape), diff, _rel(diff, size),
                               diff <= atol + rtol * size))
    return rows


def spread(runs: Sequence[State]) -> float:
    """The largest difference between any rank's tensor and rank 0's."""
    return max((max_abs(run[name], t) for run in runs[1:] for name, t in runs[0].items()), default=0.0)


def _rel(diff: float, size: float) -> float:
    if diff == 0:
        return 0.0
    return diff / size if size > 0 else float("inf")


def changed_buffers(base: nn.Module, full: nn.Module) -> dict[str, list[str]]:
    """Module name -> its own buffers that the full-batch forward changed."""
    changed: dict[str, list[str]] = {}
    for (name, module), after in zip(base.named_modules(), full.modules(), strict=True):
        for (bname, b0), b1 in zip(module.named_buffers(recurse=False),
                                   after.buffers(recurse=False), strict=True):
            if not torch.equal(b0, b1):
                changed.setdefault(name, []).append(bname)
    return changed
