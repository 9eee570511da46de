"""Parameters that moved outside ``optimizer.step()``: the step found them changed since the
window opened. A weight decay applied by hand scales every parameter by one factor ``r`` at each
application, so the factor over a window tells how often it ran: ``r**k`` on every window of ``k``
micro-batches (after every backward), or ``r`` whatever ``k`` (once per window)."""

from __future__ import annotations

import math

import torch

from gradaccum.testing import _words as words
from gradaccum.testing._evidence import Probe

__all__ = ["shrink", "why_moved"]


def shrink(start: dict[str, torch.Tensor], now: dict[str, torch.Tensor], tol: float = 1e-9) -> float | None:
    """The one factor ``r`` with ``now == r * start`` on every parameter, within ``tol`` of the
    largest (1.0: unmoved), or None."""
    if not now:
        return 1.0
    a = torch.cat([start[n].flatten() for n in now])
    b = torch.cat([now[n].flatten() for n in now])
    denom = float(a @ a)
    if denom == 0:
        return None
    r = float(a @ b) / denom
    top = max(float(b.abs().max()), 1e-300)
    return r if float((b - r * a).abs().max()) <= tol * top else None


def why_moved(window: int, factor: float | None, probes: list[Probe], tol: float = 1e-9) -> tuple[str, str]:
    """The words for parameters moved outside the step in ``window`` (1-based), by ``factor`` (the
    one factor they were scaled by, or None), read against the probes' factors by micro-batches
    (equal within ``tol``, relative)."""
    seen = sorted({(len(p.sizes), p.shrink) for p in probes if p.shrink is not None})
    one = next((r for k, r in seen if k == 1), None)
    shown = ", ".join(f"{r:.6g} on {k}" for k, r in seen)
    why = f"why: at window {window}'s step the parameters were not those the window opened with"
    if factor is None:
        return words.MOVED, why + " (not one factor on every parameter)"
    why += f": every one times {factor:.6g}; by micro-batches k, the factor was {shown}"
    several = len({k for k, _ in seen}) > 1
    if one is not None and several and all(math.isclose(r, one ** k, rel_tol=tol) for k, r in seen):
        return words.decay_by_hand(1 - one, every=True), why + f" ({one:.6g}**k)"
    if several and all(math.isclose(r, factor, rel_tol=tol) for _, r in seen):
        return words.decay_by_hand(1 - factor, every=False), why
    return words.MOVED, why
