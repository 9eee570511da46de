"""A gradient clamped entry by entry (``clip_grad_value_``): the step's gradient holds several
entries at one largest magnitude ``v``, and a weighting of the micro-batches, clamped at ``v``
after every micro-batch (or once, at the end), gives it on every split tried."""

from __future__ import annotations

import torch

from gradaccum.testing import _words as words
from gradaccum.testing._combination import solve
from gradaccum.testing._evidence import Probe, close, distinct_bases

__all__ = ["clamped"]


def _value(seen: torch.Tensor, tol: float) -> float | None:
    """``v`` when at least 2 entries of ``seen`` sit at its largest magnitude ``v``."""
    v = float(seen.abs().max()) if seen.numel() else 0.0
    at = int((seen.abs() >= v * (1 - tol)).sum())
    return v if v > 0 and at >= 2 else None


def _fits(p: Probe, base: str, v: float, each: bool, tol: float) -> bool:
    assert p.parts is not None
    w = solve(p.parts, p.bases[base], tol)
    if w is None:
        return False
    if not each:
        return close(p.seen, p.bases[base].clamp(-v, v), tol)
    total = torch.zeros_like(p.parts[0])
    for weight, g in zip(w, p.parts, strict=True):
        total = (total + weight * g).clamp(-v, v)
    return close(p.seen, total, tol)


def clamped(probes: list[Probe], tol: float) -> tuple[str, str] | None:
    """``(words, why)`` when one clamp rule and one weighting give every probe's gradient."""
    if not probes or any(p.parts is None for p in probes):
        return None
    values = [_value(p.seen, tol) for p in probes]
    if any(v is None for v in values):
        return None
    found = [(base, each) for base in distinct_bases(probes, tol) for each in (True, False)
             if all(_fits(p, base, v, each, tol) for p, v in zip(probes, values, strict=True) if v)]
    if len({each for _, each in found}) != 1:
        return None
    base, each = found[0]
    if not any(v and float(p.bases[base].abs().max()) > v * (1 + 100 * tol)
               for p, v in zip(probes, values, strict=True)):
        return None  # a clamp that changed nothing is no evidence
    shown = ", ".join(dict.fromkeys(f"{v:.4g}" for v in values if v))
    return (words.clamped(each, shown), f"why: the window gradient is the micro-batches weighted "
            f"{words.weightings([base])}, clamped entry by entry at {shown} "
            f"{'after every micro-batch' if each else 'once'}, on every split tried")
