"""Section b: memory and time against the micro-batch, one global batch (the benchmark CNN).

The time of a window is measured twice: in this process (malloc as launched) and in a child
process started with glibc's ``MALLOC_MMAP_MAX_=0`` and a large ``MALLOC_TRIM_THRESHOLD_``.
glibc serves large blocks with ``mmap`` and gives freed memory back to the OS; a large
micro-batch's activations then come back as fresh pages on every micro-batch, and the page
faults can cost more than the arithmetic. The variables must be set before the process starts,
hence the child. Run as ``python -m gradaccum.bench.sweep`` it prints the timings as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from gradaccum.bench.config import Sizes, micro_batches
from gradaccum.bench.loops import build_loop
from gradaccum.bench.measure import allocator_memory, floor_bytes, minor_faults

__all__ = ["TUNED_MALLOC", "SweepRow", "WindowTime", "run_sweep", "time_windows"]

# Keep freed memory in the heap: no mmap for large blocks, no trimming back to the OS.
TUNED_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "2147483647"}


@dataclass(frozen=True)
class WindowTime:
    """Median seconds per window and mean minor page faults per window at one micro-batch."""

    micro_batch: int
    seconds: float
    faults: float


@dataclass
class SweepRow:
    """One micro-batch of the sweep: allocator peak, floor (bytes) and window times."""

    model: str
    micro_batch: int
    steps: int
    peak: int
    floor: int
    launched: WindowTime
    tuned: WindowTime | None


def _batches(sizes: Sizes, micro: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Same items for every micro-batch: the global batch, split differently.
    return micro_batches(sizes.sweep_model, micro, sizes.global_batch // micro, device)


def time_windows(sizes: Sizes, device: torch.device) -> list[WindowTime]:
    """Time gradaccum's window at each micro-batch of the sweep (after one warm-up window)."""
    rows = []
    for micro in sizes.sweep:
        batches = _batches(sizes, micro, device)
        loop = build_loop("gradaccum", sizes.sweep_model, len(batches), device)
        loop.window(batches)
        seconds, faults = [], []
        for _ in range(sizes.sweep_repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            f0, t0 = minor_faults(), time.perf_counter()
            loop.window(batches)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - t0)
            faults.append(minor_faults() - f0)
        rows.append(WindowTime(micro, statistics.median(seconds), statistics.fmean(faults)))
        del loop, batches
    return rows


def _time_in_child(sizes: Sizes, device: torch.device) -> list[WindowTime]:
    argv = [sys.executable, "-m", "gradaccum.bench.sweep", "--model", sizes.sweep_model,
            "--global-batch", str(sizes.global_batch),
            "--sweep", ",".join(map(str, sizes.sweep)), "--repeats", str(sizes.sweep_repeats),
            "--device", str(device), "--threads", str(torch.get_num_threads())]
    env = {**os.environ, **TUNED_MALLOC}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    return [WindowTime(**row) for row in json.loads(out.strip().splitlines()[-1])]


def _peak_and_floor(sizes: Sizes, micro: int, device: torch.device) -> tuple[int, int]:
    batches = _batches(sizes, micro, device)

    def two_windows() -> object:
        loop = build_loop("gradaccum", sizes.sweep_model, len(batches), device)
        loop.window(batches)
        loop.window(batches)  # with the optimizer's state allocated
        return loop

    loop, memory = allocator_memory(two_windows, device)
    return memory.peak, floor_bytes(loop.model, loop.optimizer)  # type: ignore[attr-defined]


def run_sweep(sizes: Sizes, device: torch.device, malloc_compare: bool = True) -> list[SweepRow]:
    """Section b: allocator peak, floor and time per window at every micro-batch of the sweep.

    Args:
        sizes: the global batch and micro-batches.
        device: where it trains.
        malloc_compare: also time the windows in a child process with :data:`TUNED_MALLOC`
            (CPU only: the variables change glibc's malloc, not a GPU allocator).
    """
    launched = time_windows(sizes, device)
    tuned = _time_in_child(sizes, device) if malloc_compare and device.type == "cpu" else None
    rows = []
    for i, micro in enumerate(sizes.sweep):
        peak, floor = _peak_and_floor(sizes, micro, device)
        rows.append(SweepRow(sizes.sweep_model, micro, sizes.global_batch // micro, peak, floor, launched[i],
                             None if tuned is None else tuned[i]))
    return rows


def _main() -> None:
    parser = argparse.ArgumentParser(description="time the sweep's windows; print JSON")
    parser.add_argument("--model", required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--sweep", required=True, help="micro-batches, comma-separated")
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = Sizes(overhead=(), steps=1, repeats=1, sample_seconds=0.0, sweep_model=args.model,
                  global_batch=args.global_batch, sweep=tuple(int(m) for m in args.sweep.split(",")),
                  sweep_repeats=args.repeats, seed_models=(), seed_micro_batch=1)
    rows = time_windows(sizes, torch.device(args.device))
    print(json.dumps([row.__dict__ for row in rows]))


if __name__ == "__main__":
    _main()
