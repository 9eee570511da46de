"""Which known mistake explains a window's gradient: every hypothesis tried on several splits at once.

A hypothesis is a weighting of the micro-batches (the full batch's, a mean of micro-batch means, a
mean weighted by their rows or by some count) times a scale rule (1, ``1/k``, ``k``, ``k/N``, a
constant), clipped as the reference clips; or a weighting's running sum clipped on every
micro-batch; or its micro-batches' shares each clipped on its own, then summed. It stands when it gives
the gradient the optimizer saw on every split tried (within a tolerance of the dtype's), and a
cause is named only when one hypothesis stands; a weighting equal to a simpler one on every split
(a mean of means over micro-batches of equal counts) is that one, not evidence. One ratio alone
never names a cause.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["Hypothesis", "Probe", "clip", "close", "distinct_bases", "explain", "fits", "scale_under_clip",
           "unit"]


@dataclass(frozen=True)
class Probe:
    """One split's first window.

    Attributes:
        sizes: the micro-batch sizes.
        seen: the gradient the optimizer stepped on (flat, float64).
        bases: weightings of the micro-batches, before clipping: ``"full"`` (the full batch's
            gradient), and with a ``loss_fn`` ``"means"`` (the mean of micro-batch means),
            ``"items"`` (a mean weighted by their rows) and ``"count:<where>"`` /
            ``"shifted:<where>"`` (a mean weighted by a label tensor's count of tokens, before or
            after the shift).
        clipped_each: by weighting, its running sum clipped after every micro-batch, and
            (``"own:<weighting>"``) the sum of its micro-batches' shares each clipped on its own
            (with a ``loss_fn`` and a clip norm).
        parts: each micro-batch's own gradient, one row each (with a ``loss_fn``), or None.
        lrs: each parameter group's learning rate at the step.
        shrink: the one factor the parameters were scaled by outside the step (1.0: unmoved; None:
            moved otherwise).
    """

    sizes: tuple[int, ...]
    seen: torch.Tensor
    bases: dict[str, torch.Tensor]
    clipped_each: dict[str, torch.Tensor] = field(default_factory=dict)
    parts: torch.Tensor | None = None
    lrs: tuple[float, ...] = ()
    shrink: float | None = 1.0


@dataclass(frozen=True)
class Hypothesis:
    """A weighting ``base`` times the scale rule ``family`` (``param``: its N or constant)."""

    base: str
    family: str
    param: float = 0.0

    def factor(self, k: int) -> float:
        """The scale this hypothesis gives a window of ``k`` micro-batches."""
        if self.family == "fixed":
            return k / self.param
        return {"exact": 1.0, "twice": 1.0 / k, "not divided": float(k), "constant": self.param,
                "clip each": 1.0, "clip own": 1.0}[self.family]


def clip(vector: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """``vector`` clipped as ``torch.nn.utils.clip_grad_norm_`` clips (the same coefficient)."""
    if max_norm is None:
        return vector
    return vector * min(1.0, max_norm / (float(vector.norm()) + 1e-6))


def scale_under_clip(seen: torch.Tensor, pre: torch.Tensor, max_norm: float) -> float | None:
    """``s`` when ``seen`` is ``s * pre`` clipped at ``max_norm``, read from the ``1e-6`` that
    ``clip_grad_norm_`` adds to the norm (``|seen| = max_norm * s|pre| / (s|pre| + 1e-6)``): the
    scale that clipping otherwise hides. float64 only: the difference is about 1e-7 of the norm."""
    n, f = float(seen.norm()), float(pre.norm())
    if seen.dtype != torch.float64 or f == 0 or not 0 < max_norm - n < 1e-4 * max_norm:
        return None
    return 1e-6 * n / (f * (max_norm - n))


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Equal within ``tol`` of the larger's largest entry."""
    top = max(float(a.abs().max()) if a.numel() else 0.0, float(b.abs().max()) if b.numel() else 0.0)
    return a.numel() == 0 or float((a - b).abs().max()) <= tol * max(top, 1e-300)


def fits(h: Hypothesis, probe: Probe, clip_norm: float | None, tol: float) -> bool:
    """Whether ``h`` gives the gradient the optimizer saw on ``probe``.

    Where both ``h``'s gradient and the one seen are clipped, only their directions are compared:
    their norms then differ by clipping's ``1e-6`` alone, which is no evidence of a scale.
    """
    if h.family == "clip each":
        each = probe.clipped_each.get(h.base)
        return each is not None and close(probe.seen, each, tol)
    if h.family == "clip own":  # the clipped shares' sum, clipped again at the window or not
        own = probe.clipped_each.get(f"own:{h.base}")
        return own is not None and (close(probe.seen, own, tol)
                                    or close(probe.seen, clip(own, clip_norm), tol))
    base = probe.bases.get(h.base)
    if base is None:
        return False
    pre = base * h.factor(len(probe.sizes))
    if close(probe.seen, clip(pre, clip_norm), tol):
        return True
    at_clip = clip_norm is not None and float(pre.norm()) >= clip_norm and \
        float(probe.seen.norm()) >= clip_norm * (1 - 1e-4)
    return at_clip and close(unit(probe.seen), unit(pre), tol)


def unit(vector: torch.Tensor) -> torch.Tensor:
    """``vector`` over its norm (itself when 0)."""
    norm = float(vector.norm())
    return vector / norm if norm > 0 else vector


def distinct_bases(probes: list[Probe], tol: float) -> list[str]:
    """The weightings the probes can tell apart: one equal to an earlier one on every probe (a
    mean of means over micro-batches of equal counts, say) is the earlier one, not evidence."""
    kept: list[str] = []
    for base in probes[0].bases:
        if not any(all(close(p.bases[base], p.bases[other], tol) for p in probes) for other in kept):
            kept.append(base)
    return kept


def _candidates(probes: list[Probe], clip_norm: float | None, tol: float) -> list[Hypothesis]:
    """Every hypothesis worth trying, in order of simplicity, its free parameter fitted on the probes."""
    kmax = max(len(p.sizes) for p in probes)
    out = []
    for base in distinct_bases(probes, tol):
        out += [Hypothesis(base, f) for f in ("exact", "twice", "not divided")]
        out += [Hypothesis(base, "fixed", n) for n in range(2, 4 * kmax + 1)]
        for p in probes:  # a constant factor, fitted where the optimizer saw an unclipped gradient
            b = p.bases[base]
            clipped = clip_norm is not None and float(p.seen.norm()) >= clip_norm * (1 - 1e-4)
            if clipped or float(b.norm()) == 0:
                continue
            c = float(p.seen @ b) / float(b @ b)
            if c > 0 and not math.isclose(c, 1.0, rel_tol=tol):
                out.append(Hypothesis(base, "constant", c))
            break
    out += [Hypothesis(base, family) for family in ("clip each", "clip own")
            for base in distinct_bases(probes, tol)
            if all(base in p.clipped_each for p in probes)]
    return out


def explain(probes: list[Probe], clip_norm: float | None, tol: float) -> list[Hypothesis]:
    """The hypotheses that give every probe's gradient, simplest first. One alone is the diagnosis;
    several mean the evidence does not tell them apart (clipping can hide a scale, say)."""
    return [h for h in _candidates(probes, clip_norm, tol) if all(fits(h, p, clip_norm, tol) for p in probes)]
