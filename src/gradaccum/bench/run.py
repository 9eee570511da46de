"""Run every section of the benchmark and write the report and its figures."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from gradaccum.bench.config import FULL, SMOKE
from gradaccum.bench.exactness import run_exactness
from gradaccum.bench.machine import describe_machine
from gradaccum.bench.overhead import run_overhead
from gradaccum.bench.plots import plot_exactness, plot_memory, plot_overhead
from gradaccum.bench.report import Results, write_report
from gradaccum.bench.resident import run_resident
from gradaccum.bench.results import TIME_TARGET
from gradaccum.bench.sweep import run_sweep

__all__ = ["FIGURES", "REPORT", "RESULTS", "run_bench"]

REPORT = "BENCHMARKS.md"
RESULTS = "results/bench.json"  # beside the report: docs/results/bench.json by default
FIGURES = {"overhead": "bench_overhead.png", "memory": "bench_memory.png",
           "exactness": "bench_exactness.png"}


def run_bench(out: Path, *, smoke: bool = False, device: str = "cpu", threads: int | None = None,
              malloc_compare: bool = True, command: str = "gradaccum bench",
              log: Callable[[str], None] = print, data_dir: Path | None = None) -> Path:
    """Measure overhead, memory, exactness and the seed's buffers; write the report into ``out``.

    Args:
        out: the folder for ``BENCHMARKS.md`` and its PNG figures.
        smoke: tiny sizes (seconds) that only prove every path runs.
        device: where the timed and measured training runs (exactness always runs on CPU).
        threads: ``torch.set_num_threads`` first (default: leave torch's choice).
        malloc_compare: also time the memory sweep with tuned glibc malloc settings (CPU).
        command: the command line the report says generated it.
        log: progress lines.
        data_dir: the MNIST folder (default: the checkout's copy, else the user's cache).

    Returns:
        The report's path.

    Example:
        >>> run_bench(Path("/tmp/bench"), smoke=True)  # doctest: +SKIP
        PosixPath('/tmp/bench/BENCHMARKS.md')
    """
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(out, smoke, torch.device(device), malloc_compare, command, log, data_dir)
    finally:
        torch.set_num_threads(previous_threads)


def _run(out: Path, smoke: bool, dev: torch.device, malloc_compare: bool, command: str,
         log: Callable[[str], None], data_dir: Path | None) -> Path:
    sizes = SMOKE if smoke else FULL
    machine = {**describe_machine(), "device": str(dev)}
    start = time.perf_counter()

    def section(title: str) -> None:
        log(f"gradaccum bench: {title} ({time.perf_counter() - start:.0f} s so far)")

    section("overhead against the hand-written loop")
    overhead = run_overhead(sizes, dev, log, data_dir)
    section("memory against micro-batch")
    sweep = run_sweep(sizes, dev, malloc_compare)
    section("exactness")
    exactness = run_exactness(data_dir)
    section("the seed's accumulator")
    resident = run_resident(sizes, dev, data_dir)
    section("report")
    out.mkdir(parents=True, exist_ok=True)
    plot_overhead(overhead, out / FIGURES["overhead"], TIME_TARGET)
    plot_memory(sweep, out / FIGURES["memory"])
    plot_exactness(exactness, out / FIGURES["exactness"])
    results = Results(machine, command, time.perf_counter() - start, smoke, overhead, sweep,
                      exactness, resident, FIGURES)
    return write_report(results, out / REPORT, out / RESULTS, _cited_as(out / RESULTS))


def _cited_as(path: Path) -> str:
    """The results file as the report's markers name it: from the working directory (the
    checkout's root, where ``gradaccum bench`` is run), else absolute."""
    resolved = path.resolve()
    return str(resolved.relative_to(Path.cwd())) if resolved.is_relative_to(Path.cwd()) else str(resolved)
