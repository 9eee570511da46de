"""Sections a and c (time): gradaccum and Accelerate against the hand-written loop, same work."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gradaccum.bench.config import Sizes, micro_batches
from gradaccum.bench.loops import Loop, accelerate_available, build_loop, window_memory
from gradaccum.bench.measure import Memory, Timings, device_sync, interleaved

__all__ = ["BASELINE", "OverheadResult", "contenders", "run_overhead"]

BASELINE = "hand-written"


@dataclass
class OverheadResult:
    """One task: a model at a micro-batch, N micro-batches per window.

    Attributes:
        model, micro_batch, steps: the task.
        calls: windows per timed sample.
        timings: seconds per optimizer step, per contender and round.
        memory: the allocator memory of building each contender and training one window.
    """

    model: str
    micro_batch: int
    steps: int
    calls: int
    timings: Timings
    memory: dict[str, Memory]


def contenders() -> list[str]:
    """The loops compared: the hand-written one first, Accelerate when it is installed."""
    names = [BASELINE, "gradaccum"]
    return [*names, "accelerate"] if accelerate_available() else names


def run_task(model: str, micro_batch: int, sizes: Sizes, device: torch.device,
             data_dir: Path | None = None) -> OverheadResult:
    """Measure one task: allocator memory of each contender, then interleaved timings
    (``data_dir``: where MNIST is, for the MLP; see :func:`~gradaccum.bench.config.micro_batches`).

    Example:
        >>> from gradaccum.bench.config import SMOKE
        >>> r = run_task("mlp", 4, SMOKE, torch.device("cpu"))  # doctest: +SKIP
    """
    steps, names = sizes.steps, contenders()
    batches = micro_batches(model, micro_batch, 2 * steps, device, data_dir=data_dir)
    windows = [batches[:steps], batches[steps:]]
    memory = {name: window_memory(name, model, windows[0], device)[1] for name in names}
    loops = {name: build_loop(name, model, steps, device) for name in names}
    sync = device_sync(device)

    def timed(loop: Loop) -> Callable[[], None]:
        order = itertools.cycle(windows)
        return lambda: loop.window(next(order))

    fns = {name: timed(loop) for name, loop in loops.items()}
    # The first window of each (optimizer state, allocator, thread pools) is not timed.
    first = interleaved(fns, repeats=1, calls=1, sync=sync, warmup=False)
    calls = 1
    if first.median(BASELINE) < sizes.sample_seconds:  # fill a sample with short windows
        probe = interleaved({BASELINE: fns[BASELINE]}, repeats=3, calls=1, sync=sync, warmup=False)
        calls = max(1, round(sizes.sample_seconds / probe.median(BASELINE)))
    # A window that fills a sample by itself is warm after the first; short ones get a round.
    timings = interleaved(fns, sizes.repeats, calls, sync, warmup=calls > 1)
    return OverheadResult(model, micro_batch, steps, calls, timings, memory)


def run_overhead(sizes: Sizes, device: torch.device, log: Callable[[str], None] = print,
                 data_dir: Path | None = None) -> list[OverheadResult]:
    """Section a (and c's timings): every task of ``sizes.overhead``."""
    results = []
    for model, micro_batch in sizes.overhead:
        log(f"  overhead: {model}, micro-batch {micro_batch} x {sizes.steps}")
        result = run_task(model, micro_batch, sizes, device, data_dir)
        for name in contenders()[1:]:
            log(f"    {name}: ratio {result.timings.ratio(name, BASELINE):.3f}, peak difference "
                f"{result.memory[name].peak - result.memory[BASELINE].peak:+d} B")
        results.append(result)
    return results
