"""The window's weights of its micro-batches over the full batch's own weights: which count the loop
got wrong, read from how each micro-batch's share is off.

A loop's window gradient reads as ``sum c_i g_i`` (:mod:`gradaccum.testing._combination`); the full
batch's is ``sum f_i g_i``, ``f_i = n_i / N`` for micro-batch ``i``'s count ``n_i`` of what the loss
averages. Their ratios ``r_i = c_i / f_i`` show a count taken in the wrong place:

* ``r = (m, 1, ..., 1)``: the first micro-batch's gradient added ``m`` times (the last, likewise);
* ``r_i = n_i``: each micro-batch's gradient times its own count (a summed loss given as a mean);
* ``r_i = 1 / n_i``: each micro-batch's mean divided by its count again (a mean given as a sum);
* ``r_i = N / n_first`` on every ``i``: the window divided by one micro-batch's count, not its own;
* ``r_i = N / (N + d k)``: a count off by ``d`` on every micro-batch (``n_items + 1``).

A rule is named only when it holds on every split read (within the evidence's tolerance), the
counts ``n_i = N f_i`` whole numbers for the batch's own count ``N`` (its tokens or rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

__all__ = ["Shares", "ratio_rules"]


@dataclass(frozen=True)
class Shares:
    """One split: its sizes, its weights ``coef`` (as read, unnormalized: None where the gradient
    was clipped) and the full batch's own weights ``full`` (summing to 1)."""

    sizes: tuple[int, ...]
    coef: torch.Tensor
    full: torch.Tensor
    clipped: bool = False


def _near(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= 10 * tol * max(abs(a), abs(b), 1e-300)


def _whole(values: list[float], tol: float) -> bool:
    """Whole numbers (at least 1), to ``10 * tol`` absolute: a count's fraction is no rounding."""
    return all(v > 0.5 and abs(v - round(v)) <= 10 * tol for v in values)


def _counted(rule: str, shares: list[Shares], tol: float) -> int | None:
    """``m`` when the first (``rule == "first"``) or last micro-batch's gradient is added ``m``
    times (m >= 2 whole) and every other's once, on every split of several micro-batches."""
    several = [s for s in shares if len(s.sizes) > 1]
    found: set[int] = set()
    for s in several:
        r = (s.coef / s.full).tolist()
        at = 0 if rule == "first" else len(r) - 1
        rest = [v for i, v in enumerate(r) if i != at]
        unit = 1.0 if not s.clipped else rest[0]  # clipped: its scale is the clip's, the shape stands
        if unit <= 0 or not all(_near(v, unit, tol) for v in rest) or not _whole([r[at] / unit], tol):
            return None
        found.add(round(r[at] / unit))
    m = found.pop() if len(found) == 1 else None
    return m if m is not None and m >= 2 else None


def _all(shares: list[Shares], tol: float, want: Callable[[Shares], list[float] | None]) -> bool:
    """Every unclipped split's ratios are ``want(split)`` (and there are some)."""
    read = [s for s in shares if not s.clipped]
    for s in read:
        target = want(s)
        if target is None or not all(_near(float(c / f), t, tol)
                                     for c, f, t in zip(s.coef, s.full, target, strict=True)):
            return False
    return bool(read)


def ratio_rules(shares: list[Shares], totals: list[int], tol: float) -> list[tuple[str, int, int]]:
    """Every rule that holds: ``(name, m, N)`` (``m``: the times added, or the count's offset).

    ``totals``: the batch's own counts that ``N`` may be (its tokens before and after the shift,
    its rows); the first whose ``N f_i`` are whole numbers on every split is used."""
    if len({len(s.sizes) for s in shares}) < 2 or any(bool((s.full <= 0).any()) for s in shares):
        return []
    out = []
    for rule in ("first", "last"):
        m = _counted(rule, shares, tol)
        if m is not None:
            out.append((f"{rule} counted", m, 0))
    big = next((n for n in totals if n > 1
                and all(_whole([n * float(f) for f in s.full], tol) for s in shares)), None)
    if big is None:
        return out
    if _all(shares, tol, lambda s: [big * float(f) for f in s.full]):
        out.append(("own count", 0, big))
    if _all(shares, tol, lambda s: [1 / (big * float(f)) for f in s.full]):
        out.append(("over own count", 0, big))
    for at, rule in ((0, "first's count"), (-1, "last's count")):
        if _all(shares, tol, partial(_one_count, at)):
            out.append((rule, 0, big))
    off = _off_by(shares, big, tol)
    if off:
        out.append(("off by", off, big))
    return out


def _one_count(at: int, s: Shares) -> list[float]:
    """The ratios of a window divided by micro-batch ``at``'s count: ``N / n_at`` on every one."""
    return [1 / float(s.full[at])] * len(s.sizes)


def _off_by(shares: list[Shares], big: int, tol: float) -> int:
    """``d`` (a whole number, not 0) when every unclipped split's ratios are all ``N / (N + d k)``."""
    found: set[int] = set()
    for s in shares:
        if s.clipped:
            continue
        r = (s.coef / s.full).tolist()
        if not all(_near(v, r[0], tol) for v in r) or r[0] <= 0:
            return 0
        d = (big / r[0] - big) / len(s.sizes)
        if abs(d - round(d)) > 10 * tol:
            return 0
        found.add(round(d))
    return found.pop() if len(found) == 1 and 0 not in found else 0
