"""The load-balancing loss of a mixture of experts over a whole window: its arithmetic from counts.

The loss of a batch is ``coef * E * sum_i f_i * P_i``: ``f_i`` the fraction of the batch's routes
that went to expert ``i`` (counts: no gradient), ``P_i`` the batch's mean router probability of
``i`` over its (unpadded) tokens. Both are statistics of the *batch*, so a window of micro-batches
trains the large batch's objective only when ``f`` and ``P`` are the window's (arXiv 2501.11873).

Written out, ``P_i = S_i / T`` with ``S_i`` the sum of the router probabilities of ``i`` over the
window's ``T`` tokens, so the window's loss is linear in the ``S_i``, and ``S_i`` is a sum over
micro-batches: ``loss = sum_{l,i} a_{l,i} * S_{l,i}`` with constant weights ``a`` (a function of
the counts only). Each micro-batch carries its own ``sum a * S`` (its share, exact), and this module
computes ``a`` from counts:

* pooled (``per_layer=False``, Hugging Face's ``load_balancing_loss_func``): the ``L`` layers'
  rows are pooled, ``f_i = C_i / (L T_c)`` with ``C_i`` the routes to ``i`` summed over the layers
  (top-k routes: the ``f_i`` sum to ``k``), ``P_i = S_i / (L T)``; so
  ``a_{l,i} = coef * E * C_i / (L T_c * L T)``, the same for every layer;
* per layer (``per_layer=True``: Switch, Megatron, torchtitan): each layer's
  ``E * sum_i f_{l,i} P_{l,i}``, summed, with ``f_{l,i} = C_{l,i} / (k T_c)`` (fractions of the
  layer's routes, summing to 1) and ``P_{l,i} = S_{l,i} / T``; so
  ``a_{l,i} = coef * E * C_{l,i} / (k T_c * T)``.

``T_c`` is the tokens the counts were taken over: the window's ``T`` (mode ``"global"``), the
tokens so far (``"rolling"``), or the micro-batch's own (``"micro_batch"``: Hugging Face's loss
of each micro-batch, weighted by its share of the window's tokens).

Values may be plain numbers or framework scalars: only ``+ * /`` are applied to them.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Literal

__all__ = ["MODES", "BalanceMode", "check_coef", "check_mode", "count_scale"]

BalanceMode = Literal["global", "rolling", "micro_batch"]
MODES: tuple[str, ...] = ("global", "rolling", "micro_batch")


def check_mode(mode: Any) -> BalanceMode:
    """Validate a balancing mode.

    Raises:
        ValueError: not one of :data:`MODES` (the message names them).

    Example:
        >>> check_mode("rolling")
        'rolling'
    """
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def check_coef(coef: Any) -> float:
    """Validate the balancing loss's coefficient: a finite number >= 0.

    Raises:
        TypeError: not a real number.
        ValueError: negative, NaN or infinite.

    Example:
        >>> check_coef(0.01)
        0.01
    """
    if isinstance(coef, bool) or not isinstance(coef, Real):
        raise TypeError(f"coef must be a finite number >= 0, got {coef!r}")
    value = float(coef)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"coef must be a finite number >= 0 (e.g. coef=0.01), got {coef!r}")
    return value


def count_scale(counted_tokens: Any, window_tokens: Any, *, layers: int, experts: int, top_k: int,
                per_layer: bool, coef: float) -> Any:
    """The factor that turns route counts into the weights ``a`` of the probability sums.

    Pooled: ``a_{l,i} = scale * C_i`` (``C_i`` summed over the layers); per layer:
    ``a_{l,i} = scale * C_{l,i}`` (module docstring).

    Args:
        counted_tokens: the tokens the counts were taken over (``T_c``; > 0).
        window_tokens: the window's tokens over every micro-batch and rank (``T``; > 0).
        layers: routed layers ``L``.
        experts: experts per layer ``E``.
        top_k: routes per token ``k``.
        per_layer: sum each layer's loss (True) or pool the layers (False).
        coef: the loss's coefficient.

    Example:
        >>> count_scale(4, 8, layers=2, experts=4, top_k=2, per_layer=False, coef=1.0)
        0.03125
        >>> count_scale(4, 8, layers=2, experts=4, top_k=2, per_layer=True, coef=1.0)
        0.0625
    """
    if per_layer:
        return coef * experts / (top_k * counted_tokens * window_tokens)
    return coef * experts / (layers * counted_tokens * layers * window_tokens)
