"""What :func:`gradaccum.testing.assert_accumulation_exact` reports: a line per split, then the
evidence behind a named cause, or the candidates when the evidence names none."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradaccum.testing import _words as words

__all__ = ["AccumulationReport", "SplitResult", "describe_update"]


@dataclass(frozen=True)
class SplitResult:
    """One split's run against the full batch's.

    Attributes:
        split: the micro-batch sizes (per rank under ``world_size > 1``).
        ratio: the update's L2 norm over the full batch's (all parameters together), in the first
            window that differs (over the whole run when none does).
        cosine: the cosine between the two updates (1: the same direction).
        max_abs: the largest absolute difference of any parameter (over ranks), in that window.
        ok: every parameter within ``atol + rtol * (its largest full-batch move)`` after every
            window.
        words: what the difference means.
        window: the first window that differs (1-based), or None.
    """

    split: tuple[int, ...]
    ratio: float
    cosine: float
    max_abs: float
    ok: bool
    words: str
    window: int | None = None


@dataclass(frozen=True)
class AccumulationReport:
    """Every split's result; ``str()`` is a line per split, then the evidence.

    Attributes:
        results: one :class:`SplitResult` per split.
        world_size: the ranks each split ran on.
        windows: the windows each split ran.
        why: the evidence behind the causes named, or the candidates (one line each).
        setup: the reference's schedule and clipping, in words.
    """

    results: list[SplitResult]
    world_size: int
    windows: int = 1
    why: tuple[str, ...] = ()
    setup: str = ""

    @property
    def exact(self) -> bool:
        """True when every split gave the full batch's update."""
        return all(r.ok for r in self.results)

    def __str__(self) -> str:
        where = "" if self.world_size == 1 else f" on each of {self.world_size} ranks"
        setup = f" ({self.setup})" if self.setup else ""
        verdict = "exact" if self.exact else "NOT exact"
        lines = [f"{verdict}: your step against the full batch's update{setup}"]
        for r in self.results:
            count = f"{len(r.split)} micro-batch{'es' if len(r.split) > 1 else ''}"
            state = "ok" if r.ok else f"differs at window {r.window} of {self.windows}"
            lines.append(f"  {count} of {'+'.join(map(str, r.split))}{where}: {state} "
                         f"(max abs diff {r.max_abs:.1e}): {r.words}")
        lines += [f"  {why}" for why in self.why]
        return "\n".join(lines)


def describe_update(ratio: float, cosine: float, micro_batches: int, ok: bool = False) -> str:
    """Say what one update, compared with the full batch's, is consistent with.

    One ratio names no cause: several mistakes give 0.5x on 2 micro-batches (the loss divided by
    the steps twice, a fixed N=4, a token count...). :func:`assert_accumulation_exact` runs more
    splits and names a cause only when they single it out.

    Args:
        ratio: its L2 norm over the full batch update's.
        cosine: the cosine between the two.
        micro_batches: how many micro-batches the window held (k).
        ok: the update agreed within the tolerance.

    Returns:
        The words: ``exact``, ``no update at all``, or the difference and its candidates.

    Example:
        >>> describe_update(0.25, 1.0, 4)[:95]
        'differs by 0.25x from the full batch; the candidates: divided by the steps twice (the loss by N'
    """
    k = micro_batches
    if ok:
        return f"{ratio:.4g}x the full batch: exact"
    if ratio == 0:
        return words.NO_UPDATE
    listed: list[str] = []
    if cosine < 1 - 1e-5:
        listed += words.DIRECTION
    else:
        if k > 1 and math.isclose(ratio, 1 / k, rel_tol=1e-4):
            listed.append(words.twice(k))
        if k > 1 and math.isclose(ratio, k, rel_tol=1e-4):
            listed.append(words.not_divided(k))
        fixed = next((m for m in range(2, 8 * k + 1) if m != k and math.isclose(ratio, k / m, rel_tol=1e-4)),
                     None)
        if fixed is not None:
            listed.append(words.fixed_n(k, fixed))
        listed += [*words.SCALE, "a learning rate that differs (a scheduler stepped per micro-batch)",
                   "clipping that differs from the reference's"]
    return f"{words.differs(ratio, cosine)}; the candidates: " + "; ".join(listed)
