"""One benchmark run as data: the results file (``results/bench.json``) its report's numbers bind to.

Every number the report prints is a value here, at full precision, under one key; the report
names, beside each table, the key of every number in it (tests/test_doc_numbers.py checks the
page against this file).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradaccum.bench.overhead import BASELINE, OverheadResult
from gradaccum.bench.resident import ResidentRow
from gradaccum.bench.sweep import SweepRow

__all__ = ["MIB", "TIME_TARGET", "Results", "contenders", "results_data"]

MIB = 2**20
TIME_TARGET = 1.02


@dataclass
class Results:
    """Everything one run measured, with the figures' file names (relative to the report)."""

    machine: dict[str, str]
    command: str
    seconds: float
    smoke: bool
    overhead: list[OverheadResult]
    sweep: list[SweepRow]
    exactness: dict[str, dict[str, float | None]]
    resident: list[ResidentRow]
    figures: dict[str, str]


def contenders(res: Results) -> list[str]:
    """The loops timed against the hand-written one, in the report's column order."""
    return [n for n in (res.overhead[0].timings.samples if res.overhead else {}) if n != BASELINE]


def _overhead(r: OverheadResult, names: list[str]) -> dict[str, Any]:
    t, mem = r.timings, r.memory
    every = [BASELINE, *names]
    return {"model": r.model, "micro_batch": r.micro_batch, "steps": r.steps, "calls": r.calls,
            "median_ms": {n: t.median(n) * 1e3 for n in every},
            "ratio": {n: t.ratio(n, BASELINE) for n in names},
            "quartiles": {n: list(t.paired_quartiles(n, BASELINE)) for n in names},
            "peak_mib": {n: mem[n].peak / MIB for n in every},
            "peak_minus_baseline_bytes": {n: mem[n].peak - mem[BASELINE].peak for n in names}}


def _verdict(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    worst = max(row["ratio"][name] for row in rows)
    diffs = [row["peak_minus_baseline_bytes"][name] for row in rows]
    return {"worst_ratio": worst, "time_met": worst <= TIME_TARGET, "missed_by": worst - TIME_TARGET,
            "diff_min": min(diffs), "diff_max": max(diffs)}


def _sweep(r: SweepRow) -> dict[str, Any]:
    row = {"micro_batch": r.micro_batch, "steps": r.steps, "peak_mib": r.peak / MIB,
           "floor_mib": r.floor / MIB, "peak_over_floor": r.peak / r.floor,
           "seconds": r.launched.seconds, "faults": r.launched.faults}
    if r.tuned is not None:
        row |= {"tuned_seconds": r.tuned.seconds, "tuned_faults": r.tuned.faults}
    return row


def _resident(r: ResidentRow) -> dict[str, Any]:
    return {"model": r.model, "micro_batch": r.micro_batch, "steps": r.steps,
            "param_bytes": r.param_bytes, "computed": r.computed, "resident_extra": r.resident_extra,
            "measured_minus_computed": r.resident_extra - r.computed, "peak_extra": r.peak_extra}


def results_data(res: Results) -> dict[str, Any]:
    """The run as a JSON-ready dict: the machine, then one section per table of the report."""
    names = contenders(res)
    overhead = [_overhead(r, names) for r in res.overhead]
    first = res.sweep[0] if res.sweep else None
    return {
        "machine": res.machine, "command": res.command, "seconds": res.seconds, "smoke": res.smoke,
        "targets": {"time_ratio": TIME_TARGET, "memory_bytes": 0},
        "overhead": overhead,
        "verdict": {name: _verdict(overhead, name) for name in names},
        "sweep_model": first.model if first else None,
        "sweep_global_batch": first.micro_batch * first.steps if first else None,
        "sweep": [_sweep(r) for r in res.sweep],
        "exactness": res.exactness,
        "resident": [_resident(r) for r in res.resident],
    }
