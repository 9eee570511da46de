"""BatchNorm momentum for N micro-steps per optimizer step, and the way back.

A BatchNorm layer updates its running statistics once per forward, so N micro-batches decay them
N times per optimizer step. :func:`scale_momentum_` sets each layer's momentum so that the N
updates decay like one full step (the compound rule of
:func:`gradaccum.core.momentum.scaled_momentum`, or the linear one); :func:`restore_momentum_`
undoes it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum.core.momentum import check_momentum_rule, scaled_momentum
from gradaccum.core.validate import check_positive_int
from gradaccum.torch.batchnorm.convert import is_batchnorm

__all__ = ["restore_momentum_", "scale_momentum_"]

_BASE_MOMENTUM = "_gradaccum_base_momentum"


def scale_momentum_(model: nn.Module, steps: Any, rule: Any = "compound") -> int:
    """Set every BatchNorm's momentum for ``steps`` micro-steps per optimizer step, in place.

    The rule is applied to each layer's *original* momentum (remembered on the layer), so calling
    again with a new N (an accumulation schedule) rescales rather than compounds, and
    :func:`restore_momentum_` undoes it. Layers with ``momentum=None`` (a cumulative average,
    where every batch weighs the same) are left alone: there is no decay to correct. Window
    BatchNorm layers are left alone: they update once per window already.

    Args:
        model: the model (or a single BatchNorm).
        steps: micro-steps per optimizer step (N), an integer >= 1.
        rule: ``"compound"`` (``1 - (1 - m) ** (1 / N)``: N micro-steps decay like one full step)
            or ``"linear"`` (``m / N``).

    Returns:
        The number of layers whose momentum was set.

    Raises:
        TypeError, ValueError: a bad ``steps`` or ``rule``, or a layer momentum outside [0, 1];
            raised before any layer changes.

    Example:
        >>> bn = nn.BatchNorm1d(3)
        >>> scale_momentum_(bn, 4), round(bn.momentum, 6)
        (1, 0.025996)
        >>> restore_momentum_(bn), bn.momentum
        (1, 0.1)
    """
    n = check_positive_int("steps", steps)
    rule = check_momentum_rule(rule)
    new: list[tuple[_BatchNorm, float, float]] = []
    for module in model.modules():
        if is_batchnorm(module):
            assert isinstance(module, _BatchNorm)
            base = module.__dict__.get(_BASE_MOMENTUM, module.momentum)
            if base is not None:
                new.append((module, base, scaled_momentum(base, n, rule)))
    for module, base, momentum in new:
        module.__dict__[_BASE_MOMENTUM] = base
        module.momentum = momentum
    return len(new)


def restore_momentum_(model: nn.Module) -> int:
    """Give every BatchNorm scaled by :func:`scale_momentum_` its original momentum back.

    Returns:
        The number of layers restored.
    """
    count = 0
    for module in model.modules():
        if _BASE_MOMENTUM in module.__dict__:
            module.momentum = module.__dict__.pop(_BASE_MOMENTUM)
            count += 1
    return count
