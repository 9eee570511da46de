"""The boundary of a pipeline window: one small all-reduce, then every stage steps alike (or none).

Every stage's gradients come from the last stage's weighted losses, but only the last stage knows
the window's item total, and the clip norm and an overflow span every stage. So each rank puts
into one float64 vector what it alone knows, and one SUM all-reduce over every pipeline and
data-parallel rank gives every rank the same totals (docs/PIPELINE.md):

====  ===========================================================================================
slot  what each rank adds
====  ===========================================================================================
0     the window's item total (last stages: their counts over every call)
1     the window's loss sum (last stages: ``sum(loss * weight)``)
2     the squared norm of its gradients, raw (before the correction: the corrected norm is the
      factor times the square root); under DDP only the first replica adds it (the replicas hold
      equal gradients), under FSDP2 every shard
3     1 when its gradients are not finite (its GradScaler found an inf; or the norm is inf/NaN)
4-6   1 on a last stage; 1 when its window is item-weighted; 1 when sum-reduced
7-8   its micro-step count and its square (every rank must hold the same: the sum is then ``W``
      times the value, and only equal values give both sums)
9-10  the size of the next window and its square (the ranks' ``steps`` schedules agree)
11    the loss's dtype (last stages), so ``window_loss`` is the same on every rank
12-   for each problem of torch/pipeline/checks.py, 1 when this rank recorded it in the window
====  ===========================================================================================

From the reduced vector every rank computes the same factor (``P * D / T``, ``D`` the replicas;
``N / micro_steps`` for a mean window), the same global norm and clip coefficient, the same skip
decision, and the same window loss.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn.utils import get_total_norm

from gradaccum.core.window import Window
from gradaccum.torch._boundary import Outcome
from gradaccum.torch._grads import scale_grads_
from gradaccum.torch._precision import Precision, active_scaler, scaler_found_inf
from gradaccum.torch._window_loss import WindowLoss, weighted_sum
from gradaccum.torch.pipeline.checks import PROBLEMS, describe
from gradaccum.torch.pipeline.sync import PipelineSync

__all__ = ["step_pipeline_window"]

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_FIXED = 12


def step_pipeline_window(window: Window, sync: PipelineSync, precision: Precision,
                         clip_norm: float | None) -> Outcome:
    """Reduce, check, normalize, clip and step one pipeline window on this rank.

    Raises:
        ValueError: a rank recorded a bad input in this window, or the ranks disagree on its
            length or the next one's (every rank raises; nothing is stepped).
        Whatever the scaler or the optimizer raises.
    """
    if sync.wide_buffers:
        precision.average_over_ranks(sync.dp[0])  # float32 sums, reduced once (DDP reduced nothing)
    grads = precision.window_grads()
    vec = _vector(window, sync, precision, grads, clip_norm is not None or precision.skip_nonfinite)
    sync.all_reduce(vec)
    got = vec.tolist()
    _check(got, window, sync)
    total, lasts, items, summed = got[0], got[4], got[5] > 0, got[6] > 0
    if summed and total == 0:  # no item anywhere: no step, as a summed window of 0 items
        precision.abort()
        return Outcome(False, window.basis)
    factor = (window.scale or 1.0) * lasts / total if items else window.size / window.micro_step
    norm = None
    coef = 1.0
    if clip_norm is not None or precision.skip_nonfinite:
        norm = abs(factor) * math.sqrt(got[2])
        if clip_norm is not None:
            coef = min(1.0, clip_norm / (norm + 1e-6)) if math.isfinite(norm) else 1.0
    if got[3] > 0:
        _skip_everywhere(precision)
    scale_grads_(grads, factor * coef)
    norm_t = None if norm is None else torch.tensor(norm, dtype=torch.float64)
    stepped, norm_t = precision.step(grads, norm_t)
    dtype = _DTYPES[round(got[11] / lasts) - 1] if lasts else torch.float64
    denominator = total if items else lasts * window.micro_step * sync.n_microbatches
    loss = WindowLoss(((torch.tensor(got[1] / denominator, dtype=dtype), 1),), 1)
    basis = window.basis
    if window.scale is not None and items:
        per = total / lasts / window.micro_step
        basis = int(per) if float(per).is_integer() else per
    return Outcome(stepped, basis, loss, norm_t, no_grads=not grads)


def _vector(window: Window, sync: PipelineSync, precision: Precision, grads: list[torch.Tensor],
            need_norm: bool) -> torch.Tensor:
    """This rank's entries (module docstring), as one float64 tensor on the reduction device."""
    last = sync.has_last and window.weighting is not None
    items = last and window.weighting == "items"
    loss_sum = weighted_sum(window.losses) if last else None
    nonfinite = 0.0
    scaler = active_scaler(precision.scaler)
    if scaler is not None and grads:
        nonfinite = float(scaler_found_inf(scaler, precision.optimizer))
    ms, nxt = window.micro_step, sync.next_size()
    dtype = 0 if loss_sum is None else _DTYPES.index(loss_sum.dtype) + 1 if loss_sum.dtype in _DTYPES else 1
    problems = {code for code, _ in sync.poison}
    plain = [0.0, 0.0, 0.0, nonfinite, float(sync.has_last), float(items),
             float(last and window.summed), ms, ms * ms, nxt, nxt * nxt, float(dtype),
             *(1.0 if code in problems else 0.0 for code in PROBLEMS)]
    vec = torch.tensor(plain, dtype=torch.float64, device=sync.ranks.device)
    if items:
        vec[0] = _as_tensor(window.items, vec)
    if loss_sum is not None:
        vec[1] = loss_sum.detach().reshape(()).to(vec.device, torch.float64)
    if need_norm and grads and sync.dp_lead:
        local = [getattr(g, "_local_tensor", g) for g in grads]
        vec[2] = get_total_norm(local, foreach=True).to(vec.device, torch.float64).square()
    return vec


def _as_tensor(value: Any, like: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(like.device, torch.float64)
    return float(value)


def _check(got: list[float], window: Window, sync: PipelineSync) -> None:
    """Raise on every rank if a rank recorded a problem or the ranks' windows differ."""
    ranks = sync.ranks.world_size
    issues = []
    for code, count in zip(PROBLEMS, got[_FIXED:], strict=True):
        if count:
            mine = [detail for seen, detail in sync.poison if seen == code]
            others = " and others" if count > 1 else ""
            where = f"on this rank{others}" if mine else f"on {int(count)} rank(s)"
            issues.append(describe(code, "; ".join(filter(None, mine)) or None) + f" [{where}]")
    ms, nxt = window.micro_step, sync.next_size()
    if got[7] != ranks * ms or got[8] != ranks * ms * ms:
        issues.append(f"the ranks reached the window's boundary after different numbers of calls "
                      f"(this rank: {ms}, the mean: {got[7] / ranks:g}); every stage and replica must "
                      "call backward_pipeline the same number of times per window")
    if got[9] != ranks * nxt or got[10] != ranks * nxt * nxt:
        issues.append(f"the ranks' steps give different sizes to the next window (this rank: {nxt}): "
                      "build every rank's Accumulator with the same steps")
    sync.poison = []
    if issues:
        raise ValueError("backward_pipeline: this window was dropped on every rank, nothing was "
                         "stepped: " + "; ".join(issues))


def _skip_everywhere(precision: Precision) -> None:
    """A rank's gradients are not finite: make this rank skip too (its GradScaler backs off as
    the others do), or, without one, let ``skip_nonfinite`` see a non-finite norm."""
    scaler = active_scaler(precision.scaler)
    if scaler is None:
        return
    record = scaler._per_optimizer_states[id(precision.optimizer)]["found_inf_per_device"]
    if not record:
        record[torch.device("cpu")] = torch.ones((), dtype=torch.float32)
    for value in record.values():
        value.fill_(1.0)
