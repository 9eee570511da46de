"""The benchmark's PNG figures: overhead ratios, memory against micro-batch, exactness."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradaccum.bench.overhead import BASELINE, OverheadResult
from gradaccum.bench.sweep import SweepRow

__all__ = ["plot_exactness", "plot_memory", "plot_overhead"]

MIB = 2**20
TINY = 1e-18  # a difference of exactly 0 has no place on a log axis


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_overhead(results: list[OverheadResult], path: Path, target: float) -> Path:
    """Bars: time per optimizer step over the hand-written loop's, per task and contender."""
    plt = _pyplot()
    names = [n for n in results[0].timings.samples if n != BASELINE] if results else []
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / max(len(names), 1)
    for k, name in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(results))]
        ratios = [r.timings.ratio(name, BASELINE) for r in results]
        quartiles = [r.timings.paired_quartiles(name, BASELINE) for r in results]
        errors = [[max(v - q[0], 0) for v, q in zip(ratios, quartiles, strict=True)],
                  [max(q[1] - v, 0) for v, q in zip(ratios, quartiles, strict=True)]]
        ax.bar(xs, ratios, width, yerr=errors, capsize=3, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(target, color="red", linestyle="--", linewidth=0.8, label=f"target {target}")
    ax.set_xticks(range(len(results)),
                  [f"{r.model}\n{r.micro_batch} x {r.steps}" for r in results])
    ax.set(ylabel="time per step / hand-written loop's",
           title="Overhead against a hand-written loop (median, paired-ratio quartiles)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_memory(rows: list[SweepRow], path: Path) -> Path:
    """Allocator peak and floor against the micro-batch; time per window, malloc as launched and tuned."""
    plt = _pyplot()
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    micro = [r.micro_batch for r in rows]
    ax_mem.plot(micro, [r.peak / MIB for r in rows], marker="o", label="allocator peak")
    ax_mem.plot(micro, [r.floor / MIB for r in rows], linestyle="--",
                label="floor: parameters + gradients + optimizer state")
    ax_mem.set(xscale="log", xlabel="micro-batch (same global batch)", ylabel="MiB",
               title="Memory against micro-batch")
    ax_mem.set_ylim(bottom=0)
    ax_time.plot(micro, [r.launched.seconds for r in rows], marker="o", label="malloc as launched")
    if all(r.tuned is not None for r in rows):
        ax_time.plot(micro, [r.tuned.seconds for r in rows if r.tuned is not None], marker="s",
                     label="MALLOC_MMAP_MAX_=0, large MALLOC_TRIM_THRESHOLD_")
    ax_time.set(xscale="log", xlabel="micro-batch (same global batch)", ylabel="seconds per window",
                title="Time per optimizer step")
    ax_time.set_ylim(bottom=0)
    for ax in (ax_mem, ax_time):
        ax.set_xticks(micro, [str(m) for m in micro])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_exactness(results: dict[str, dict[str, float | None]], path: Path) -> Path:
    """Bars (log scale): max |parameter difference| against the full batch, per case and method."""
    plt = _pyplot()
    cases = list(results)
    methods = list(next(iter(results.values()))) if results else []
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / max(len(methods), 1)
    for k, method in enumerate(methods):
        xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(cases))]
        values = [results[c][method] for c in cases]
        ax.bar(xs, [TINY if v is None else max(v, TINY) for v in values], width, label=method)
    ax.set_xticks(range(len(cases)), cases)
    ax.set(yscale="log", ylabel="max |parameter - full batch's| (float64)",
           title="Exactness against the full batch")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)
