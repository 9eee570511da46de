"""BatchNorm momentum for N micro-steps per update: the arithmetic, shared by every backend.

A BatchNorm layer updates its running statistics on every training forward,
``running = (1 - m) * running + m * batch_stat`` (PyTorch's convention; MindSpore's ``momentum``
is ``1 - m``). Under accumulation there are N forwards per optimizer step, so the running
statistics forget N times faster per update than in the large-batch run. Two corrections:

* ``"compound"``: ``m' = 1 - (1 - m) ** (1 / N)``, so that ``(1 - m') ** N = 1 - m``: N
  micro-steps decay the old statistics exactly as one full step does.
* ``"linear"``: ``m' = m / N`` (Composer's ghost BatchNorm), the first-order approximation of
  the compound rule; it decays a little less (``(1 - m / N) ** N > 1 - m``).
"""

from __future__ import annotations

from typing import Any, Literal

from gradaccum.core.validate import check_positive_int

__all__ = ["MOMENTUM_RULES", "MomentumRule", "check_momentum_rule", "scaled_momentum"]

MomentumRule = Literal["compound", "linear"]
MOMENTUM_RULES: tuple[str, ...] = ("compound", "linear")


def check_momentum_rule(rule: Any) -> MomentumRule:
    """Return ``rule`` if it is one of :data:`MOMENTUM_RULES`, else raise naming it."""
    if rule not in MOMENTUM_RULES:
        raise ValueError(f"rule must be one of {list(MOMENTUM_RULES)}, got {rule!r}")
    return rule  # type: ignore[no-any-return]


def scaled_momentum(momentum: Any, steps: Any, rule: Any = "compound") -> float:
    """The BatchNorm momentum for ``steps`` micro-steps per optimizer step.

    Args:
        momentum: the momentum of one full-batch step, in PyTorch's convention (weight of the new
            batch statistic), a number in [0, 1] (0: frozen statistics stay frozen).
        steps: micro-steps per optimizer step (N), an integer >= 1.
        rule: ``"compound"`` (``1 - (1 - m) ** (1 / N)``) or ``"linear"`` (``m / N``).

    Returns:
        The per-micro-step momentum (``momentum`` itself when ``steps`` is 1).

    Raises:
        TypeError, ValueError: a bad ``momentum``, ``steps`` or ``rule`` (the message names it).

    Example:
        >>> round(scaled_momentum(0.1, 4), 6)
        0.025996
        >>> scaled_momentum(0.1, 4, "linear")
        0.025
    """
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        raise TypeError(f"momentum must be a number in [0, 1], got {momentum!r} "
                        f"({type(momentum).__name__})")
    if not 0.0 <= momentum <= 1.0:  # also rejects NaN
        raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
    n = check_positive_int("steps", steps)
    rule = check_momentum_rule(rule)
    if n == 1:
        return float(momentum)
    if rule == "linear":
        return float(momentum) / n
    return float(1.0 - (1.0 - float(momentum)) ** (1.0 / n))
