"""What the ranks of a pipeline agree on, and the mistakes each one can see (docs/PIPELINE.md).

A stage that raised on its own while the others entered ``schedule.step()`` would leave them
waiting in point-to-point communication. So a rank never raises on its own about a call's input:
it records the problem, the ranks exchange what they recorded, and every rank raises the same
error together.

* **What a rank sees** (:func:`check_call`): the schedule's ``loss_fn`` and ``scale_grads``, its
  stages, the optimizer's parameters, the last stage's ``target`` and ``n_items``, ``n_items``
  elsewhere, the window's weighting, and gradients changed outside the accumulator.
* **The agreement** (:func:`agreement_vector`, one MAX all-reduce before a ``step()``): at the
  run's first call, and when the window or schedule changed outside ``backward_pipeline``
  (``load_state_dict``, ``flush``, ``discard``, ``set_epoch``, another schedule). The ranks compare
  the window's size and position, the schedule's micro-batches and options, the accumulator's
  options, and each rank's problems; the last stage tells every rank how the window is weighted.
* **Later calls**: a problem only one rank can see is recorded, the ``step()`` runs harmlessly
  (a zero loss), and the window's boundary all-reduce carries it: every rank raises there and no
  rank steps (torch/pipeline/boundary.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradaccum.core.window import Window
from gradaccum.torch._validate import check_items, short_repr

__all__ = ["CALL", "FLUSH", "PROBLEMS", "Agreed", "Call", "agreement_vector", "check_call", "describe",
           "read_agreement"]

CALL, FLUSH = 1, 2  # what a rank is doing when it agrees: a backward_pipeline call, or flush()

# Every problem a rank can record about a call, and what it means (the detail comes from the rank).
PROBLEMS: dict[str, str] = {
    "loss_fn": "the schedule has no loss_fn: build it with loss_fn= (the loss of one pipeline "
               "micro-batch; gradaccum weights each one in the window)",
    "scale_grads": "the schedule was built with scale_grads=True (its default): it divides every "
                   "stage's gradients by n_microbatches at the end of each step(), so under "
                   "accumulation each step rescales the gradient already accumulated (torchtitan "
                   "#1733); build it with scale_grads=False: gradaccum weights each micro-batch itself",
    "target": "the last stage was called with target=None: pass the batch's labels as target= on "
              "the rank that holds the last stage",
    "n_items_missing": "reduction='sum' needs the items' count on the last stage: pass n_items=lambda "
                       "target: (target != -100).sum() (a function of each pipeline micro-batch's "
                       "target) or the batch's count",
    "n_items_number": "n_items is one count for the batch, but with reduction='mean' each pipeline "
                      "micro-batch's mean must be weighted by its own count: pass a function of the "
                      "target chunk, n_items=lambda target: (target != -100).sum(), or sum-reduce the "
                      "loss (reduction='sum')",
    "n_items_bad": "n_items on the last stage is not a count, a function of the target, or None: "
                   "pass n_items=lambda target: (target != -100).sum(), the batch's count with "
                   "reduction='sum', or None (every pipeline micro-batch weighs alike)",
    "n_items_elsewhere": "n_items was given on a stage that is not the last: only the last stage, "
                         "where the labels are, counts the items; pass n_items there only",
    "reduction": "reduction must be 'mean' or 'sum': pass how loss_fn reduces a micro-batch's items",
    "weighting": "the last stage mixes weightings inside one window (n_items on some calls, none on "
                 "others): give n_items on every call of the window or on none",
    "stages": "the schedule runs other stages than the ones this accumulator's window was built on: "
              "build one Accumulator per schedule (over its stages' parameters), or feed the "
              "first schedule again",
    "params": "the optimizer holds parameters that are in none of this rank's pipeline stages: pass "
              "the stage modules' parameters (all stages this rank runs) to the optimizer",
    "gradients": "the window's gradients (or the scheduler) were changed outside the accumulator, "
                 "or another accumulator holds an open window over them",
}
_CODES = tuple(PROBLEMS)
# (name, what it is) of every value the ranks must hold alike: (v, -v) in a MAX all-reduce.
_PAIRS = ("operation", "steps", "micro_step", "n_microbatches", "num_stages", "scaler", "clip_norm",
          "skip_nonfinite")


@dataclass(frozen=True)
class Agreed:
    """What every rank learned from the agreement.

    Attributes:
        use_scale: a provisional total ``P`` scales the backward seeds (some rank's gradients can
            overflow: a GradScaler, float16 parameters).
        first_count: the largest first count of any last stage (the first window's ``P`` basis).
        poisoned: a rank recorded a problem earlier in the window (its boundary raises).
        items: a last stage weighs its losses by item counts (told to every stage).
    """

    use_scale: bool
    first_count: float
    poisoned: bool = False
    items: bool = False


def agreement_vector(pairs: Sequence[float], last: Sequence[float], problems: Sequence[str],
                     rank: int) -> list[float]:
    """This rank's entries of the agreement: each pair value and its negation, then ``last``
    (has_last, items, summed, first_count, overflow_prone, poisoned; the maximum is kept), then for
    each problem code ``rank + 1`` where this rank recorded it."""
    out: list[float] = []
    for v in pairs:
        out += [float(v), -float(v)]
    out += [float(v) for v in last]
    out += [float(rank + 1) if code in problems else 0.0 for code in _CODES]
    return out


def read_agreement(vec: Sequence[float], mine: dict[str, str]) -> Agreed:
    """Decode the reduced agreement.

    Args:
        vec: the element-wise maximum of every rank's :func:`agreement_vector`.
        mine: this rank's problems (code -> detail), named first in the message.

    Raises:
        ValueError: the ranks disagree on a value or one recorded a problem (every rank sees the
            same vector, so every rank raises, before any ``step()``).
    """
    n = len(_PAIRS)
    issues = []
    for i, name in enumerate(_PAIRS):
        high, low = vec[2 * i], -vec[2 * i + 1]
        if high == low:
            continue
        if name == "operation":
            issues.append("some ranks call backward_pipeline while others call flush(): every stage and "
                          "replica must call backward_pipeline the same number of times per window")
        elif name == "micro_step":
            issues.append(f"the ranks are at different calls of the window (from {_num(low)} to "
                          f"{_num(high)} calls made): every stage and replica must call "
                          "backward_pipeline the same number of times, and restore the same checkpoint")
        else:
            issues.append(f"the ranks disagree on {name}: from {_num(low)} to {_num(high)} (build every "
                          "rank's Accumulator and schedule with the same options)")
    _, items, _, first_count, overflow_prone, poisoned = vec[2 * n: 2 * n + 6]
    flags = vec[2 * n + 6:]
    for code, flag in zip(_CODES, flags, strict=True):
        if flag:
            issues.append(describe(code, mine.get(code), int(flag) - 1))
    if issues:
        raise ValueError("backward_pipeline: nothing was run or stepped, on any rank: " + "; ".join(issues))
    return Agreed(use_scale=bool(overflow_prone), first_count=first_count, poisoned=bool(poisoned),
                  items=bool(items))


def describe(code: str, detail: str | None, rank: int | None = None) -> str:
    """One problem's sentence: what it means, where it was seen, and this rank's detail."""
    where = "" if rank is None else f" (rank {rank})"
    return PROBLEMS[code] + where + ("" if not detail else f": {detail}")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)


@dataclass
class Call:
    """One ``backward_pipeline`` call: its checked input, and what its ``step()`` recorded."""

    last: bool
    reduction: str
    n_items: Any
    target: Any = None
    problems: dict[str, str] = field(default_factory=dict)
    counts: list[Any] = field(default_factory=list)
    parts: list[tuple[torch.Tensor, Any]] = field(default_factory=list)
    raw: list[torch.Tensor] = field(default_factory=list)

    @property
    def items(self) -> bool:
        return self.n_items is not None

    @property
    def summed(self) -> bool:
        return self.reduction == "sum"


def check_call(sync: Any, schedule: Any, target: Any, n_items: Any, reduction: Any, n_mb: int,
               window: Window, check_grads: Callable[[Window], None]) -> Call:
    """This rank's problems with a ``backward_pipeline`` call (recorded, never raised here).

    Args:
        sync: the accumulator's PipelineSync; n_mb: the schedule's micro-batches; window: the
            accumulator's window record; check_grads: its gradient guards for a micro-batch of
            ``window`` (a RuntimeError they raise is recorded as the ``"gradients"`` problem).
    """
    call = Call(sync.has_last, reduction if reduction in ("mean", "sum") else "mean",
                n_items if sync.has_last else None, target)
    problems = call.problems
    if reduction not in ("mean", "sum"):
        problems["reduction"] = f"got {reduction!r}"
    if getattr(schedule, "_loss_fn", None) is None:
        problems["loss_fn"] = ""
    if getattr(schedule, "scale_grads", False):
        problems["scale_grads"] = ""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    if [id(s) for s in stages] != [id(s) for s in sync.stages]:
        problems["stages"] = ""
    if getattr(sync, "foreign", 0):
        problems["params"] = f"{sync.foreign} of them"
    if sync.has_last:
        _check_last(call, target, n_items, n_mb, window)
    elif n_items is not None:
        problems["n_items_elsewhere"] = f"n_items={short_repr(n_items, 40)} on a rank holding stage(s) " \
                                        f"{[s.stage_index for s in sync.stages]}"
    try:
        check_grads(window)  # stale or edited gradients, a scheduler stepped outside, another window
    except RuntimeError as e:
        problems["gradients"] = str(e)
    return call


def _check_last(call: Call, target: Any, n_items: Any, n_mb: int, window: Window) -> None:
    problems = call.problems
    if target is None:
        problems["target"] = ""
    if n_items is None:
        if call.summed:
            problems["n_items_missing"] = ""
    elif not callable(n_items):
        try:
            check_items(n_items, call.reduction)
        except (TypeError, ValueError) as e:
            problems["n_items_bad"] = str(e)
        else:
            if not call.summed and n_mb > 1:
                problems["n_items_number"] = f"got n_items={short_repr(n_items, 40)} for {n_mb} micro-batches"
    if window.weighting is not None and window.weighting != ("items" if call.items else "mean") \
            and "n_items_missing" not in problems:
        problems["weighting"] = f"its first {window.micro_step} call(s) " \
                                f"{'gave n_items' if window.weighting == 'items' else 'gave none'}"
    if problems:
        call.n_items = None  # a harmless step: its weight is 0 (the window raises at its boundary)


