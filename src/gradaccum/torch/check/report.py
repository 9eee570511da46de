"""The equivalence checker's report as text: settings, a per-tensor table, the verdict, the fixes."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import Any

from gradaccum.torch.check.hazards import Hazard

__all__ = ["CheckReport", "TensorDiff", "format_report"]

WIDTH = 100


@dataclass(frozen=True)
class TensorDiff:
    """How one parameter or buffer differs after the two runs.

    Attributes:
        name: the parameter's or buffer's qualified name.
        kind: ``"param"`` or ``"buffer"``.
        shape: its shape.
        max_abs: the largest absolute difference between the two runs.
        rel: ``max_abs`` over the reference scale: the largest update of the parameter in the
            full-batch run (largest absolute value, for a buffer); 0 when both are 0.
        ok: ``max_abs <= atol + rtol * scale``.
        updated: False for a parameter that the step left unchanged in both runs (no gradient).
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    max_abs: float
    rel: float
    ok: bool
    updated: bool = True


@dataclass
class CheckReport:
    """The result of :func:`check_equivalence`; ``str(report)`` is a readable table.

    Attributes:
        equivalent: True when every parameter and buffer agrees within the tolerance and no
            module breaks equivalence (a dropout layer's masks may line up by chance).
        diffs: one :class:`TensorDiff` per parameter and buffer, in model order.
        hazards: the modules that break equivalence, with the gradaccum fix for each.
        settings: what was run (model label, batch, steps, dtype, atol, rtol, loss;
            ``loss_dtype``, and ``judged_dtype``: the dtype whose tolerance applies, the least
            precise of the model's and the loss's; ``world_size`` and ``rank_spread``: the largest
            difference between ranks; ``n_items`` and ``micro_n_items``: the item counts the loss
            returned for the full batch and for each micro-batch (rank 0's first), None when it
            returned a bare mean loss; ``count_hint``: which count the loss values fit, when
            ``n_items`` did not).
    """

    equivalent: bool
    diffs: list[TensorDiff]
    hazards: list[Hazard]
    settings: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return format_report(self)


def format_report(report: CheckReport) -> str:
    """Render a :class:`CheckReport` as a readable table.

    Returns:
        The settings, one row per parameter and buffer (max absolute and relative difference),
        the verdict, and each module that breaks equivalence with its gradaccum fix.
    """
    s = report.settings
    world = s.get("world_size", 1)
    micro = f"{s['steps']} micro-batch{'es' if s['steps'] != 1 else ''} of {s['micro_batch']}"
    against = micro if world == 1 else f"{world} DDP ranks (gloo processes) of {micro} each"
    head = (f"gradaccum check: {s['model']} ({s['dtype']}, {s['device']}), one SGD step (lr 1) on a "
            f"batch of {s['batch']} against {against}, from the same weights and RNG state (loss: "
            f"{s['loss']}). A tensor agrees when max|diff| <= atol + rtol * scale, atol={s['atol']:g}, "
            f"rtol={s['rtol']:g}; scale: the parameter's largest full-batch update, the buffer's "
            "largest value.")
    lines = [*textwrap.wrap(head + _precision(s) + _weighting(s), WIDTH), "", *_table(report)]
    worst = max((d.rel for d in report.diffs), default=0.0)
    bad = sum(not d.ok for d in report.diffs)
    if report.equivalent:
        lines += ["", f"EQUIVALENT: all {len(report.diffs)} tensors agree "
                      f"(largest relative difference {_num(worst)})."]
    elif bad:
        lines += ["", f"NOT EQUIVALENT: {bad} of {len(report.diffs)} tensors differ "
                      f"(largest relative difference {_num(worst)})."]
    else:
        lines += ["", *textwrap.wrap(
            f"NOT EQUIVALENT: all {len(report.diffs)} tensors agree here (largest relative difference "
            f"{_num(worst)}), but the modules below break equivalence in general: here their random "
            "draws or buffer updates happened to line up.", WIDTH)]
    skipped = [d.name for d in report.diffs if d.kind == "param" and not d.updated]
    if skipped:
        lines += textwrap.wrap(f"Note: no gradient reached {', '.join(skipped)}: the check says "
                               "nothing about them.", WIDTH)
    if world > 1 and not report.equivalent:
        lines += textwrap.wrap(f"The ranks ended {_num(s['rank_spread'])} apart (largest difference "
                               "of any tensor from rank 0's).", WIDTH)
    lines += textwrap.wrap(_count_mismatch(s), WIDTH)
    if report.hazards:
        lines += ["", "Modules that break equivalence:"]
        for h in report.hazards:
            lines.append(f"  {h.module} ({h.kind})")
            lines += textwrap.wrap(h.problem, WIDTH, initial_indent="    what: ",
                                   subsequent_indent="          ")
            lines += textwrap.wrap(h.fix, WIDTH, initial_indent="    fix:  ",
                                   subsequent_indent="          ")
    elif not report.equivalent:
        lines += ["", *textwrap.wrap("No module was named: the difference comes from the loss or from "
                                     "an operation outside any module. " + _loss_hint(s), WIDTH)]
    return "\n".join(lines)


def _precision(s: dict[str, Any]) -> str:
    """A note when the loss is less precise than the model: the tolerance follows the loss."""
    judged = s.get("judged_dtype", s["dtype"])
    if judged == s["dtype"]:
        return ""
    return (f" The loss is {s['loss_dtype']} while the model is {s['dtype']}: its gradients carry "
            f"{judged}'s rounding, so the tolerance is {judged}'s.")


def _weighting(s: dict[str, Any]) -> str:
    if s.get("n_items") is None:
        return ""
    return (f" Item-weighted: the loss returned (loss, n_items), so the full batch's loss is its mean "
            f"over its {_count(s['n_items'])} items and each micro-batch went through "
            f"acc.backward(loss, n_items) with n_items {', '.join(map(_count, s['micro_n_items']))}.")


def _count_mismatch(s: dict[str, Any]) -> str:
    """A note when the micro-batches' counts do not add up to the full batch's."""
    full, micro = s.get("n_items"), s.get("micro_n_items")
    if full is None or not micro or math.isclose(sum(micro), full, rel_tol=1e-9, abs_tol=1e-9):
        return ""
    return (f"Note: the micro-batches' n_items sum to {_count(sum(micro))} but the full batch's is "
            f"{_count(full)}: n_items must count the items of its own batch.")


def _loss_hint(s: dict[str, Any]) -> str:
    if s.get("n_items") is None:
        return ("A mean over a number of items (tokens) that varies between micro-batches does this: "
                "let the loss return (loss, n_items).")
    return str(s.get("count_hint") or "Does n_items count exactly the items the loss averages over?")


def _count(x: float) -> str:
    return f"{x:g}"


def _table(report: CheckReport) -> list[str]:
    header = ("tensor", "kind", "shape", "max abs diff", "rel diff", "agrees")
    rows = [(d.name, d.kind, "x".join(map(str, d.shape)) or "()", _num(d.max_abs), _num(d.rel),
             "yes" if d.ok else "NO") for d in report.diffs]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for row in [header, *rows]:
        cells = [c.ljust(w) if i < 3 else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}"
