"""Which count did the loss average over? The hint for an item-weighted check that failed.

An item-weighted window is exact when each micro-batch's ``n_items`` is the number of items its
mean loss averages over. The loss values tell which count that is: the full batch's mean loss
``M`` and the micro-batches' ``m_i`` over ``c_i`` items satisfy ``M = sum(m_i c_i) / sum(c_i)``.
The usual counts of integer targets (``!= -100``, ``!= -1`` or another negative label, each
with and without a causal LM's shift) are tried against that identity; one that fits, where the
``n_items`` passed do not, is the count the loss averaged over.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradaccum.torch.tokens import count_tokens

__all__ = ["CountRule", "count_hint", "loss_count"]


@dataclass(frozen=True)
class CountRule:
    """A way to count integer targets: those not equal to ``ignore_index``, shifted or not."""

    ignore_index: int
    shift: bool

    def __str__(self) -> str:
        keyword = "" if self.ignore_index == -100 else f", ignore_index={self.ignore_index}"
        return f"count_tokens(labels{keyword}{', shift=True' if self.shift else ''})"

    def counts(self, targets: torch.Tensor, steps: int) -> list[int]:
        """This rule's count for each of ``steps`` equal parts of ``targets``."""
        return [int(count_tokens(t, ignore_index=self.ignore_index, shift=self.shift))
                for t in targets.chunk(steps)]


def _rules(targets: torch.Tensor) -> list[CountRule]:
    ignored = {-100, -1} | {int(v) for v in torch.unique(targets) if int(v) < 0}
    shifts = (False, True) if targets.dim() >= 2 else (False,)
    return [CountRule(i, s) for i in sorted(ignored) for s in shifts]


def _fits(full_loss: float, losses: Sequence[float], counts: Sequence[float], rtol: float) -> bool:
    total = sum(counts)
    if total <= 0:
        return False
    pooled = sum(m * c for m, c in zip(losses, counts, strict=True) if c) / total
    return math.isclose(pooled, full_loss, rel_tol=rtol, abs_tol=rtol)


def _proportional(a: Sequence[float], b: Sequence[float]) -> bool:
    sa, sb = sum(a), sum(b)
    return sa > 0 and sb > 0 and all(math.isclose(x / sa, y / sb, rel_tol=1e-9, abs_tol=1e-12)
                                     for x, y in zip(a, b, strict=True))


def loss_count(targets: torch.Tensor | None, steps: int, full_loss: float, losses: Sequence[float],
               passed: Sequence[float], loss_dtype: torch.dtype) -> tuple[CountRule, list[int]] | None:
    """The count of ``targets`` that the loss values show it averaged over, when ``passed`` is not.

    Args:
        targets: the full batch's targets (integer labels; anything else gives None).
        steps: the number of micro-batches.
        full_loss: the full batch's loss value.
        losses: each micro-batch's loss value.
        passed: each micro-batch's ``n_items``.
        loss_dtype: the loss's dtype: the precision the identity is checked to.

    Returns:
        ``(rule, its count per micro-batch)``, or None: the counts passed fit, no target count
        fits, or the targets are not integer labels.

    Example:
        >>> labels = torch.tensor([[1, 2, -100], [3, 4, 5]])  # 2 + 3 labels; 1 + 2 once shifted
        >>> rule, counts = loss_count(labels, 2, 2.0, [1.0, 2.5], [2, 3], torch.float32)
        >>> str(rule), counts  # (1.0 * 1 + 2.5 * 2) / 3 == 2.0; (1.0 * 2 + 2.5 * 3) / 5 != 2.0
        ('count_tokens(labels, shift=True)', [1, 2])
    """
    if targets is None or targets.is_floating_point() or targets.dtype == torch.bool or targets.dim() == 0:
        return None
    rtol = 100 * torch.finfo(loss_dtype).eps if loss_dtype.is_floating_point else 1e-6
    if _fits(full_loss, losses, passed, rtol):
        return None
    for rule in _rules(targets):
        counts = rule.counts(targets, steps)
        if not _proportional(counts, passed) and _fits(full_loss, losses, counts, rtol):
            return rule, counts
    return None


def count_hint(targets: torch.Tensor | None, steps: int, full_loss: float, losses: Sequence[float],
               passed: Sequence[float], loss_dtype: torch.dtype) -> str:
    """The sentence naming the count mismatch of a failed item-weighted check.

    A causal LM's shift is suggested only when the count that fits is the passed rule's shifted
    twin: one item fewer per sequence. Otherwise the two totals are named.
    """
    found = loss_count(targets, steps, full_loss, losses, passed, loss_dtype)
    total = _num(sum(passed))
    if found is None:
        return (f"Does n_items count exactly the items the loss averages over? The micro-batches' "
                f"n_items sum to {total}; no count of the targets that gradaccum tried "
                "(labels not -100 or -1, shifted or not) fits the loss values either.")
    rule, counts = found
    assert targets is not None  # found implies targets
    fitted = _num(sum(counts))
    rows = targets.shape[0]
    twin = CountRule(rule.ignore_index, not rule.shift)
    if twin.counts(targets, steps) == [round(c) for c in passed]:
        if rule.shift:
            return (f"n_items counts {total} items but the loss averaged over {fitted}, one fewer in "
                    f"each sequence that has labels ({rows} sequences): a causal LM's loss drops each "
                    f"sequence's first label, so pass n_items={rule}.")
        return (f"n_items counts {total} items but the loss averaged over {fitted}: it counts the "
                f"shifted labels, and this loss does not shift them: pass n_items={rule}, without "
                "shift=True.")
    return (f"n_items counts {total} items but the loss averaged over {fitted}: the loss values "
            f"fit a mean over {rule} (per micro-batch {', '.join(map(_num, counts))}, against the "
            f"{', '.join(map(_num, passed))} passed). Pass the count the loss itself divides by.")


def _num(x: float) -> str:
    return f"{x:g}"
