"""Causes read from what the runs recorded beyond the gradient's scale: a zero gradient at the step
(and whether a ``zero_grad()`` came after the last backward), the step's own ``all_reduce`` of the
gradients under DDP, a learning rate scaled by the window's micro-batches, a layer that mixes the
samples, and the weights of the micro-batches' own gradients (:mod:`gradaccum.testing._combination`).

Each function gives ``(words, why)`` when its evidence singles the cause out, else None.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from gradaccum.testing import _words as words
from gradaccum.testing._combination import Placed, Reading, l2_rule, read, readable, solve, support_rule
from gradaccum.testing._evidence import Probe, close
from gradaccum.testing._ratios import Shares, ratio_rules
from gradaccum.testing._runs import Job, Trace

__all__ = ["from_weights", "learning_rate", "mixing", "no_gradient", "reduced_twice", "start_vectors"]

Said = tuple[str, str]


def no_gradient(trace: Trace, w: int, seen: torch.Tensor, full: torch.Tensor) -> Said | None:
    """The optimizer stepped on a zero gradient in window ``w`` where the full batch's is not."""
    if seen.numel() == 0 or bool(seen.any()) or not bool(full.any()):
        return None
    backwards = trace.backwards[w] if w < len(trace.backwards) else 0
    events = trace.events[w] if w < len(trace.events) else []
    first = next((i for i, (kind, _) in enumerate(events) if kind == "step"), len(events))
    at_step = events[first][1] if first < len(events) else 0
    cleared = any(kind == "zero_grad" and b == at_step for kind, b in events[:first])
    how = "zero_grad" if at_step and cleared else "none" if not backwards else ""
    passes = f"{backwards} backward pass{'es' if backwards != 1 else ''}"
    after = ", then zero_grad() before the step" if how == "zero_grad" else ""
    return (words.no_gradient(how),
            f"why: the optimizer stepped on a zero gradient in window {w + 1}, after {passes}{after}")


def reduced_twice(trace: Trace, w: int, world: int, seen: torch.Tensor, full: torch.Tensor,
                  tol: float) -> Said | None:
    """The step all-reduced the gradients with SUM itself, on top of DDP's average."""
    calls = [op for window in trace.grad_reduces[:w + 1] for op in window]
    if "SUM" not in calls:
        return None
    times = "is" if close(seen, world * full, tol) else "is not"
    return (words.reduced_twice(world),
            f"why: your step called all_reduce(SUM) on {calls.count('SUM')} gradients by window {w + 1}, "
            f"after DDP's backward had averaged them over the {world} ranks; the gradient the "
            f"optimizer saw {times} {world}x the full batch's")


def learning_rate(probes: list[Probe], ref_lr: float, k: int) -> tuple[Said, int] | None:
    """The learning rate at the step is k times (or 1/k times) the full batch's on every split:
    what to say, and the power of k (1 or -1)."""
    seen = [(len(p.sizes), p.lrs[0] / ref_lr) for p in probes if p.lrs and ref_lr]
    if len({k for k, _ in seen}) < 2:
        return None
    for rule, power in (("times", 1), ("over", -1)):
        if all(math.isclose(r, float(n) ** power, rel_tol=1e-9) for n, r in seen):
            ks = ", ".join(f"{n}: {r:.4g}x" for n, r in sorted(set(seen)))
            return (words.learning_rate(rule, k),
                    "why: the gradient is the full batch's, and the learning rate at the step over "
                    f"the full batch's, by the micro-batches k, was {ks}"), power
    return None


def mixing(probes: list[Probe], model: Callable[[], nn.Module], tol: float) -> Said | None:
    """The full batch's gradient is no weighting of its micro-batches' own gradients (``model()``
    builds the model whose layers are named then)."""
    apart = [p for p in probes if p.parts is not None and len(p.sizes) > 1 and readable(p.parts)
             and solve(p.parts, p.bases["full"], tol) is None]
    if not apart:
        return None
    found = [(type(m).__name__, name) for name, m in model().named_modules() if m.training and (
        isinstance(m, _BatchNorm) or (isinstance(m, _DropoutNd) and m.p > 0))]
    said = "; ".join(words.mixing_layer(kind, name) for kind, name in found) or words.LAYERS
    splits = ", ".join("+".join(map(str, p.sizes)) for p in apart)
    loop = ""
    for p in apart:
        assert p.parts is not None
        coef = solve(p.parts, p.seen, tol)
        if coef is not None:
            loop = f"; your window gradient is one ({_weights(coef)} on {'+'.join(map(str, p.sizes))})"
            break
    return (said, f"why: the full batch's gradient is no weighting of its micro-batches' own gradients on "
                  f"{splits} (as it is for a model whose samples do not interact){loop}")


def from_weights(probes: list[Probe], trace: Trace, params: Placed, tol: float,
                 clip_norm: float | None = None, totals: tuple[int, ...] = (), k: int = 0) -> Said | None:
    """Which micro-batches reached the step, an L2 term growing with k, or a count taken in the
    wrong place (:mod:`gradaccum.testing._ratios`; ``totals``: the batch's own counts), read from
    the weights (over their sum where the gradient was clipped at ``clip_norm``); ``k``: the
    micro-batches of ``trace``'s split."""
    readings: list[Reading] = []
    for p in probes:
        if p.parts is None:
            return None
        reading = read(p.sizes, p.seen, p.parts, params, tol, clip_norm)
        if reading is None:
            return None
        readings.append(reading)
    shown = ", ".join(f"{_weights(r.coef)} on {'+'.join(map(str, r.sizes))}" for r in readings
                      if len(r.sizes) > 1)
    rule = support_rule(readings, tol)
    if rule is not None:
        how, mechanism = _mechanism(rule, trace)
        if rule == "first" and k > 1 and _repeated(trace, k):
            how, mechanism = "repeated", mechanism + f" of {k} micro-batches, no zero_grad() between them"
        return (words.SUPPORT[rule, how], "why: the window gradient weights the micro-batches' own "
                f"gradients {shown}{mechanism}")
    l2 = l2_rule(readings, params, tol)
    if l2 is not None:
        rule, _, tensors = l2
        held = ", ".join(f"{r.decay.get(tensors[0], 0.0):.4g} on {'+'.join(map(str, r.sizes))}"
                         for r in readings)
        return (words.l2_penalty(rule),
                f"why: the window gradient is a weighting of the micro-batches' own gradients plus a "
                f"multiple of the parameters {', '.join(tensors)} themselves: {held}")
    return _from_ratios(probes, readings, totals, tol, clip_norm, shown)


def _from_ratios(probes: list[Probe], readings: list[Reading], totals: tuple[int, ...], tol: float,
                 clip_norm: float | None, shown: str) -> Said | None:
    """A count taken in the wrong place: the weights over the full batch's own weights."""
    shares = []
    for p, r in zip(probes, readings, strict=True):
        assert p.parts is not None
        full = solve(p.parts, p.bases["full"], tol)
        if full is None or r.decay:
            return None
        clipped = clip_norm is not None and float(p.seen.norm()) >= clip_norm * (1 - 1e-4)
        shares.append(Shares(r.sizes, r.coef, full / full.sum(), clipped))
    found = ratio_rules(shares, list(totals), tol)
    if not found:
        return None
    said = words.ratio_rule(found)
    full_shown = ", ".join(f"{_weights(s.full)} on {'+'.join(map(str, s.sizes))}" for s in shares
                           if len(s.sizes) > 1)
    return said, (f"why: the window gradient weights the micro-batches' own gradients {shown}, where the "
                  f"full batch weights them {full_shown}")


def start_vectors(job: Job) -> Placed:
    """Each parameter's start values (float64, flat) and its offset in the flat gradient."""
    out, offset = {}, 0
    for n in job.names:
        values = job.state[n].detach().double().flatten()
        out[n] = (offset, values)
        offset += values.numel()
    return out


def _repeated(trace: Trace, k: int) -> bool:
    """The first window held k backward passes and no zero_grad() between them (its one micro-batch
    that has weight then went through backward k times)."""
    events = trace.events[0] if trace.events else []
    return bool(trace.backwards) and trace.backwards[0] == k and not any(
        kind == "zero_grad" and 0 < b < k for kind, b in events)


def _mechanism(rule: str, trace: Trace) -> tuple[str, str]:
    """How the step left micro-batches out, from its first window's backward passes and zero_grad()."""
    backwards = trace.backwards[0] if trace.backwards else 0
    events = trace.events[0] if trace.events else []
    cleared = {b for kind, b in events if kind == "zero_grad"}
    passes = f"; {backwards} backward pass{'es' if backwards != 1 else ''} in the window"
    if rule != "last":
        return "", passes
    if backwards > 1 and all(b in cleared for b in range(1, backwards)):
        return "zero_grad", passes + ", a zero_grad() before each one after the first"
    if backwards == 1:
        return "once", passes
    return "", passes


def _weights(coef: torch.Tensor) -> str:
    """``(0, 0, 1)``: the weights, those below 1e-9 of the largest written 0."""
    top = float(coef.abs().max())
    return "(" + ", ".join("0" if abs(c) <= 1e-9 * top else f"{c:.3g}" for c in coef.tolist()) + ")"
