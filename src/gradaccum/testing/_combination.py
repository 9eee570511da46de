"""The window gradient read as a combination of its micro-batches' own gradients.

Accumulation of any per-item or per-token mean gives a window gradient that is a weighting of the
micro-batches' own gradients ``g_i`` (each ``loss_fn`` on micro-batch ``i`` alone): ``sum c_i g_i``.
With more parameters than micro-batches the weights ``c`` are fixed by the gradient itself (least
squares, on ``g_i`` that are clearly independent), so they can be read:

* the full batch's gradient is no such weighting: a layer (or the loss) mixes the samples of a
  batch, or draws random numbers (BatchNorm, dropout);
* ``c`` is zero except on the last micro-batch (``zero_grad()`` inside the loop, a loss
  overwritten), on the largest ones (the smaller dropped), ...;
* the gradient also holds a multiple of the parameters themselves, growing with ``k``: an L2
  penalty added on every micro-batch.

A rule is named only when it gives every split read, and no other rule does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gradaccum.testing._evidence import close

__all__ = ["L2_RULES", "SUPPORT_RULES", "Placed", "Reading", "l2_rule", "read", "readable", "solve",
           "support_rule"]

# The most entries the reading with the parameters builds (one row per parameter tensor besides the
# micro-batches'): a model too large for it is read without an L2 term (16.7M float64: 128 MiB).
MAX_ENTRIES = 2 ** 24
# How clearly independent the columns must be (their smallest singular value over the largest,
# each column scaled to norm 1) for the weights to be read at all.
MIN_CONDITION = 1e-3


def readable(rows: torch.Tensor) -> bool:
    """Whether the weights of a combination of ``rows`` (the vectors) are fixed by it: the rows are
    clearly independent, and fewer than their entries by 2 at least."""
    return _scaled(rows) is not None


def _scaled(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``rows`` in float64 each scaled to norm 1, and their norms, when :func:`readable`; else None."""
    if rows.dim() != 2 or rows.shape[0] == 0 or rows.shape[0] + 2 > rows.shape[1]:
        return None
    wide = rows.double()
    norms = wide.norm(dim=1)
    if bool((norms == 0).any()):
        return None
    scaled = wide / norms[:, None]
    sv = torch.linalg.svdvals(scaled)
    return (scaled, norms) if float(sv[-1]) >= MIN_CONDITION * float(sv[0]) else None


def solve(columns: torch.Tensor, target: torch.Tensor, tol: float) -> torch.Tensor | None:
    """The weights ``c`` with ``c @ columns == target`` (rows of ``columns``: the vectors), or None
    when ``target`` is no such combination within ``tol`` (of its largest entry), or when the rows
    are not :func:`readable`."""
    found = _scaled(columns)
    if found is None:
        return None
    scaled, norms = found
    coef = torch.linalg.lstsq(scaled.T, target.double()[:, None]).solution[:, 0]
    if not close(coef @ scaled, target.double(), tol):
        return None
    out: torch.Tensor = coef / norms
    return out


@dataclass(frozen=True)
class Reading:
    """One split's window gradient as ``coef @ parts + sum_t decay[t] * p_t``.

    Attributes:
        sizes: the micro-batch sizes.
        coef: the weight of each micro-batch's own gradient.
        decay: by parameter tensor, the multiple of its own starting value that the gradient holds
            beyond the weighting (an L2 penalty's gradient; empty when none is needed).
        top: the gradient's largest entry (its magnitude).
    """

    sizes: tuple[int, ...]
    coef: torch.Tensor
    decay: dict[str, float]
    top: float = 1.0


Placed = dict[str, tuple[int, torch.Tensor]]  # a parameter tensor: its offset in the flat vector, its values


def _row(offset: int, values: torch.Tensor, length: int) -> torch.Tensor:
    """``values`` at ``offset`` in a flat float64 vector of zeros."""
    row = torch.zeros(length, dtype=torch.float64)
    row[offset:offset + values.numel()] = values
    return row


def read(sizes: tuple[int, ...], seen: torch.Tensor, parts: torch.Tensor, params: Placed, tol: float,
         clip_norm: float | None = None) -> Reading | None:
    """``seen`` as a weighting of ``parts`` (each micro-batch's own gradient), or of ``parts`` and
    the parameters (``params``: each tensor's start values and their offset in the flat vector).
    Where ``seen`` was clipped at ``clip_norm`` its scale is the clip's: the weights are then given
    over their sum."""
    coef = solve(parts, seen, tol)
    top = float(seen.abs().max()) if seen.numel() else 0.0
    decay: dict[str, float] = {}
    if coef is None:
        names = [n for n, (_, v) in params.items() if v.numel() and float(v.abs().max()) > 0]
        if not names or (len(sizes) + len(names)) * seen.numel() > MAX_ENTRIES:
            return None
        rows = [_row(*params[n], seen.numel())[None] for n in names]
        both = solve(torch.cat([parts, *rows]), seen, tol)
        if both is None:
            return None
        coef, decay = both[:len(sizes)], {n: float(both[len(sizes) + i]) for i, n in enumerate(names)}
    total = float(coef.sum())
    if clip_norm is not None and float(seen.norm()) >= clip_norm * (1 - 1e-4) and total != 0:
        coef, decay, top = coef / total, {n: d / total for n, d in decay.items()}, top / abs(total)
    return Reading(sizes, coef, decay, top)


def _nonzero(coef: torch.Tensor, tol: float) -> frozenset[int]:
    """The micro-batches whose weight is not 0 (all 0: none)."""
    top = float(coef.abs().max())
    return frozenset(i for i, c in enumerate(coef.tolist()) if top > 0 and abs(c) > 100 * tol * top)


Rule = Callable[[Sequence[int]], frozenset[int]]
SUPPORT_RULES: dict[str, Rule] = {
    "last": lambda sizes: frozenset({len(sizes) - 1}),
    "first": lambda sizes: frozenset({0}),
    "all but last": lambda sizes: frozenset(range(len(sizes) - 1)),
    "all but first": lambda sizes: frozenset(range(1, len(sizes))),
    "smaller dropped": lambda sizes: frozenset(i for i, n in enumerate(sizes) if n == max(sizes)),
}


def support_rule(readings: list[Reading], tol: float) -> str | None:
    """The one rule of :data:`SUPPORT_RULES` that says which micro-batches reached the step on every
    split of more than one micro-batch (and leaves one out somewhere), or None. The smaller ones
    dropped: those below the split's largest, or below one size on every split."""
    several = [r for r in readings if len(r.sizes) > 1]
    supports = [(r.sizes, _nonzero(r.coef, tol)) for r in several]
    fit = [name for name, rule in SUPPORT_RULES.items()
           if several and (all(s == rule(sizes) for sizes, s in supports)
                           or (name == "smaller dropped" and _below_one_size(supports)))
           and any(s != frozenset(range(len(sizes))) for sizes, s in supports)]
    return fit[0] if len(fit) == 1 else None


def _below_one_size(supports: list[tuple[tuple[int, ...], frozenset[int]]]) -> bool:
    """Some size t keeps, on every split, exactly the micro-batches of t items or more."""
    low, high = 0, float("inf")  # t in (low, high]
    for sizes, kept in supports:
        dropped = [n for i, n in enumerate(sizes) if i not in kept]
        low = max(low, max(dropped, default=0))
        high = min(high, min((n for i, n in enumerate(sizes) if i in kept), default=float("inf")))
    return low < high


# How an L2 term's multiple grows with k: beyond the reference's (which holds it once), k - 1;
# where loss_fn holds none, k (every micro-batch) or 1 (once per window).
L2_RULES: dict[str, Callable[[int], float]] = {"every": lambda k: k - 1.0, "every, none in loss_fn": float,
                                               "none in loss_fn": lambda k: 1.0}


def l2_rule(readings: list[Reading], params: Placed,
            tol: float) -> tuple[str, float, tuple[str, ...]] | None:
    """(rule, the multiple per unit of the rule, the tensors it holds) when every split's gradient
    holds the same multiple of the same parameters, growing with k as one rule of
    :data:`L2_RULES` says; else None."""
    if len(readings) < 2 or len({len(r.sizes) for r in readings}) < 2:
        return None
    tensors: set[tuple[str, ...]] = set()
    amounts: list[tuple[int, float]] = []
    for r in readings:
        held = {n: d for n, d in r.decay.items()
                if abs(d) * float(params[n][1].abs().max()) > 10 * tol * r.top}
        values = list(held.values())
        if values and max(values) - min(values) > 100 * tol * max(abs(v) for v in values):
            return None  # unequal multiples: not one penalty
        if values:
            tensors.add(tuple(sorted(held)))
        amounts.append((len(r.sizes), values[0] if values else 0.0))
    if len(tensors) != 1:
        return None
    for name, rule in L2_RULES.items():
        unit = next((a / rule(k) for k, a in amounts if rule(k)), None)
        if unit and all(abs(a - unit * rule(k)) <= 100 * tol * abs(unit) * max(rule(k), 1.0)
                        for k, a in amounts):
            return name, unit, tensors.pop()
    return None
