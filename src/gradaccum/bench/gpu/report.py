"""The GPU check's report: one row per check (check, measured, target, verdict), as markdown and JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradaccum.bench.gpu.check import to_jsonable

__all__ = ["SMOKE_VERDICT", "Row", "exit_status", "markdown", "summary", "table", "verdict", "write_report"]

SMOKE_VERDICT = "no CUDA: smoke"


@dataclass
class Row:
    """What one check produced.

    Attributes:
        name: its short name (``overhead``...).
        title: what it checks, for the table.
        status: ``done`` (it returned figures), ``timeout`` (its time box ran out) or ``crashed``.
        smoke: True when it ran its CPU smoke.
        measured, target: the figures and what they should be (table cells).
        met: whether the figures meet the target (``None``: not judged).
        seconds: how long it ran.
        budget_s: its time box.
        error: the exception of a crashed check, one line.
        log: its log file (progress, and the traceback of a crash).
        raw: every number it recorded.
    """

    name: str
    title: str
    status: str
    smoke: bool
    measured: str = ""
    target: str = ""
    met: bool | None = None
    seconds: float = 0.0
    budget_s: float = 0.0
    error: str = ""
    log: str = ""
    raw: dict[str, Any] = field(default_factory=dict)


def verdict(row: Row) -> str:
    """The verdict cell: PASS / FAIL on CUDA, ``no CUDA: smoke`` (``, FAIL``) without, or what stopped it.

    Example:
        >>> verdict(Row("oom", "OOM", "done", smoke=True, met=True))
        'no CUDA: smoke'
        >>> verdict(Row("oom", "OOM", "timeout", smoke=False, budget_s=50))
        'TIMEOUT after 50 s'
    """
    if row.status == "crashed":
        return f"CRASH ({row.error})" if row.error else "CRASH"
    if row.status == "timeout":
        return f"TIMEOUT after {row.budget_s:.0f} s"
    judged = "" if row.met is None else ("PASS" if row.met else "FAIL")
    if row.smoke:
        return SMOKE_VERDICT + (", FAIL" if row.met is False else "")
    return judged or "measured (no target)"


def exit_status(rows: Sequence[Row]) -> int:
    """1 when a check crashed, or ran out of time in the smoke (seconds of work: it hung); else 0.

    A missed target is a FAIL in its row, not a failed command: the report is the result.
    """
    broken = [r for r in rows if r.status == "crashed" or (r.status == "timeout" and r.smoke)]
    return 1 if broken else 0


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: Sequence[Row]) -> list[str]:
    """The table of checks: one row each (check, measured, target, verdict)."""
    lines = ["| check | measured | target | verdict |", "|---|---|---|---|"]
    for i, row in enumerate(rows, 1):
        measured = row.measured
        if row.status == "timeout":
            measured = f"ran out of its {row.budget_s:.0f} s (partial numbers below)"
        elif row.status == "crashed":
            measured = f"raised after {row.seconds:.0f} s: see {row.log}"
        lines.append(f"| {i}. {_cell(row.title)} | {_cell(measured)} | {_cell(row.target)} | "
                     f"{_cell(verdict(row))} |")
    return lines


def summary(rows: Sequence[Row], machine: dict[str, str], mode: str, seconds: float) -> str:
    """The report's head: the machine and the table of checks (what the command prints)."""
    lines = ["# GPU check", "",
             f"`bash scripts/gpu_check.sh`, mode **{mode}**, {seconds:.0f} s in all. "
             "Raw numbers: below and in `report.json`; each check's log: `logs/`.", "",
             "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in machine.items()]
    return "\n".join([*lines, "", *table(rows)])


def markdown(rows: Sequence[Row], machine: dict[str, str], mode: str, seconds: float) -> str:
    """The report: :func:`summary`, then every raw number of each check."""
    lines = [summary(rows, machine, mode, seconds), "", "## Raw numbers", ""]
    for i, row in enumerate(rows, 1):
        lines += [f"### {i}. {row.name}: {row.status}, {row.seconds:.1f} s", "", "```json",
                  json.dumps(to_jsonable(row.raw), indent=1), "```", ""]
    return "\n".join(lines)


def write_report(out: Path, rows: Sequence[Row], machine: dict[str, str], mode: str,
                 seconds: float) -> str:
    """Write ``report.md`` and ``report.json`` into ``out``; return the report's :func:`summary`."""
    (out / "report.md").write_text(markdown(rows, machine, mode, seconds))
    payload = {"mode": mode, "seconds": round(seconds, 1), "machine": machine,
               "exit_status": exit_status(rows),
               "checks": [{**asdict(r), "verdict": verdict(r)} for r in rows]}
    (out / "report.json").write_text(json.dumps(to_jsonable(payload), indent=1) + "\n")
    return summary(rows, machine, mode, seconds)
