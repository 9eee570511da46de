"""Write ``BENCHMARKS.md``: every table and sentence with a number comes from the run's results."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gradaccum.bench.overhead import BASELINE, OverheadResult
from gradaccum.bench.resident import ResidentRow
from gradaccum.bench.sweep import TUNED_MALLOC, SweepRow
from gradaccum.bench.text import EXACTNESS_NOTES, INTRO, MALLOC_NOTE, OVERHEAD_NOTES, RESIDENT_NOTES

__all__ = ["KEPT_HEADING", "TIME_TARGET", "Results", "kept_sections", "write_report"]

MIB = 2**20
TIME_TARGET = 1.02
# The report's last section comes from the GPU check (scripts/gpu_check.sh), not from this run:
# regenerating the report keeps it as it is.
KEPT_HEADING = "## GPU"


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


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _stated(machine: dict[str, str]) -> str:
    return (f"*{machine['cpu']}, {machine['cpu_count']} CPUs, device {machine['device']}; "
            f"torch {machine['torch']}; threads: {machine['torch_threads']}; "
            f"malloc: {machine['malloc']}.*")


def _others(res: Results) -> list[str]:
    return [n for n in (res.overhead[0].timings.samples if res.overhead else {}) if n != BASELINE]


def _overhead(res: Results) -> list[str]:
    names = _others(res)
    time_header = ["task", "micro x N", "windows per sample", f"{BASELINE} (ms/step)"]
    memory_header = ["task", "micro x N", f"{BASELINE} peak (MiB)"]
    for name in names:
        time_header += [f"{name} (ms/step)", f"{name} ratio [quartiles]"]
        memory_header.append(f"{name} peak - {BASELINE}'s (bytes)")
    time_rows, memory_rows = [], []
    for r in res.overhead:
        t, mem, task = r.timings, r.memory, [r.model, f"{r.micro_batch} x {r.steps}"]
        time_row = [*task, str(r.calls), f"{t.median(BASELINE) * 1e3:.2f}"]
        memory_row = [*task, f"{mem[BASELINE].peak / MIB:.1f}"]
        for name in names:
            lo, hi = t.paired_quartiles(name, BASELINE)
            time_row += [f"{t.median(name) * 1e3:.2f}", f"{t.ratio(name, BASELINE):.3f} [{lo:.3f}, {hi:.3f}]"]
            memory_row.append(f"{mem[name].peak - mem[BASELINE].peak:+,d}")
        time_rows.append(time_row)
        memory_rows.append(memory_row)
    return ["## Overhead: the same training, by hand, with gradaccum and with Accelerate", "",
            "Time per optimizer step:", "", *_table(time_header, time_rows), "", _stated(res.machine),
            "", "Allocator peak (building the model and training one window):", "",
            *_table(memory_header, memory_rows), "", _stated(res.machine), "", *_verdict(res), "",
            f"![overhead]({res.figures['overhead']})", "", *OVERHEAD_NOTES, ""]


def _verdict(res: Results) -> list[str]:
    lines = []
    for name in _others(res):
        ratios = [r.timings.ratio(name, BASELINE) for r in res.overhead]
        diffs = [r.memory[name].peak - r.memory[BASELINE].peak for r in res.overhead]
        worst = max(ratios)
        time_says = (f"met (worst {worst:.3f})" if worst <= TIME_TARGET
                     else f"missed by {worst - TIME_TARGET:.3f} (worst {worst:.3f})")
        if max(map(abs, diffs)) == 0:
            mem_says = "met"
        elif min(diffs) == max(diffs):
            mem_says = f"missed: {diffs[0]:+,d} bytes in every task"
        else:
            mem_says = f"missed: {min(diffs):+,d} to {max(diffs):+,d} bytes"
        lines.append(f"- **{name}**: time target (ratio <= {TIME_TARGET}): {time_says}; "
                     f"memory target (0 bytes): {mem_says}.")
    return lines


def _sweep(res: Results) -> list[str]:
    tuned = all(r.tuned is not None for r in res.sweep) and bool(res.sweep)
    header = ["micro-batch", "N", "allocator peak (MiB)", "floor (MiB)", "peak / floor",
              "s/window", "page faults/window"]
    if tuned:
        header += ["s/window, tuned malloc", "page faults/window, tuned malloc"]
    rows = []
    for r in res.sweep:
        row = [str(r.micro_batch), str(r.steps), f"{r.peak / MIB:,.1f}", f"{r.floor / MIB:,.1f}",
               f"{r.peak / r.floor:.2f}", f"{r.launched.seconds:.3f}", f"{r.launched.faults:,.0f}"]
        if r.tuned is not None:
            row += [f"{r.tuned.seconds:.3f}", f"{r.tuned.faults:,.0f}"]
        rows.append(row)
    settings = " ".join(f"{k}={v}" for k, v in TUNED_MALLOC.items())
    first = res.sweep[0]
    return [f"## Memory against micro-batch: {first.model}, global batch "
            f"{first.micro_batch * first.steps}", "",
            "gradaccum at each micro-batch, the same items per optimizer step (AdamW). Allocator "
            "peak: the most tensor memory held at once while building the model and training one "
            "window (after a window of one-item micro-batches, which allocates the optimizer's "
            "state). Floor: parameters + gradients + optimizer state, the least any step holds.",
            "", *_table(header, rows), "", _stated(res.machine),
            *([f"*Tuned malloc: a child process started with {settings}; its windows alternate with "
              "this process's, one by one.*"] if tuned else []), "",
            f"![memory]({res.figures['memory']})", "", *MALLOC_NOTE, ""]


def _exactness(res: Results) -> list[str]:
    methods = list(next(iter(res.exactness.values()))) if res.exactness else []
    rows = [[case, *("not installed" if v is None else f"{v:.1e}" for v in values.values())]
            for case, values in res.exactness.items()]
    return ["## Exactness: parameters against the full batch", "",
            *_table(["case", *methods], rows), "", _stated(res.machine), "",
            f"![exactness]({res.figures['exactness']})", "", *EXACTNESS_NOTES, ""]


def _resident(res: Results) -> list[str]:
    rows = [[r.model, f"{r.micro_batch} x {r.steps}", f"{r.param_bytes:,d}", f"{r.computed:,d}",
             f"{r.resident_extra:,d}", f"{r.resident_extra - r.computed:+,d}", f"{r.peak_extra:,d}"]
            for r in res.resident]
    return ["## The seed's accumulator against gradaccum: resident extra memory", "",
            *_table(["model", "micro x N", "parameter bytes", "seed's extra, computed (B)",
                     "seed's extra after a window, measured (B)", "measured - computed (B)",
                     "seed's extra at peak, measured (B)"],
                    rows), "", _stated(res.machine), "", *RESIDENT_NOTES, ""]


def kept_sections(old: str) -> list[str]:
    r"""The lines of an existing report that a run does not write: from :data:`KEPT_HEADING` on.

    Example:
        >>> kept_sections("# Benchmarks\n## Overhead\nold numbers\n## GPU\npending")
        ['## GPU', 'pending']
        >>> kept_sections("# Benchmarks\n## GPUs are elsewhere")
        []
    """
    lines = old.splitlines()
    starts = [i for i, line in enumerate(lines) if line.rstrip() == KEPT_HEADING]
    return lines[starts[0]:] if starts else []


def write_report(res: Results, path: Path) -> Path:
    """Write the report as Markdown to ``path``, keeping its GPU section (:func:`kept_sections`).

    Returns:
        ``path``.
    """
    head = ["# Benchmarks", ""]
    if res.smoke:
        head += ["> **Smoke run**: tiny sizes that only prove the benchmark runs. Its numbers mean "
                 "nothing; run `gradaccum bench` for the real ones.", ""]
    head += [f"Generated by `{res.command}` in {res.seconds:.0f} s. {INTRO}", "",
             *_table(["setting", "value"], [[k, v] for k, v in res.machine.items()]), ""]
    body = [*_overhead(res), *_sweep(res), *_exactness(res), *_resident(res)]
    kept = kept_sections(path.read_text()) if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(head + body + kept) + ("\n" if kept else ""))
    return path
