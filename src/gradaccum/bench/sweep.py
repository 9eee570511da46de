"""Section b: memory and time against the micro-batch, one global batch (the benchmark CNN).

The time of a window is measured under two malloc settings, interleaved window by window: in
this process (malloc as launched) and in a child process started with glibc's
``MALLOC_MMAP_MAX_=0`` and a large ``MALLOC_TRIM_THRESHOLD_``. glibc serves large blocks with
``mmap`` and gives freed memory back to the OS; a large micro-batch's activations then come back
as fresh pages on every micro-batch, and the page faults can cost more than the arithmetic. The
variables must be set before a process starts, hence the child, which ``python -m
gradaccum.bench.sweep`` runs: it reads micro-batch sizes on stdin and answers each with the
time and page faults of one window.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import torch

from gradaccum.bench.config import Sizes, micro_batches
from gradaccum.bench.loops import Batches, Loop, build_loop, window_memory
from gradaccum.bench.measure import device_sync, floor_bytes, minor_faults

__all__ = ["TUNED_MALLOC", "SweepRow", "WindowTime", "run_sweep"]

# Keep freed memory in the heap: no mmap for large blocks, no trimming back to the OS.
TUNED_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "2147483647"}
ANSWER = "window: "  # marks the child's answers among anything else it prints


@dataclass(frozen=True)
class WindowTime:
    """Median seconds per window and mean minor page faults per window."""

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


class _Timer(Protocol):
    def window(self, micro: int) -> tuple[float, int]: ...


class _LocalTimer:
    """Times one gradaccum window at a micro-batch, in this process (one model per micro-batch)."""

    def __init__(self, model: str, global_batch: int, device: torch.device) -> None:
        self.model, self.global_batch, self.device = model, global_batch, device
        self._current: tuple[int, Loop, Batches] | None = None

    def adopt(self, micro: int, loop: Loop, batches: Batches) -> None:
        """Time this (already warm) contender for ``micro`` from now on."""
        self._current = (micro, loop, batches)

    def release(self) -> None:
        """Drop the current model, e.g. before another one is measured."""
        self._current = None

    def window(self, micro: int) -> tuple[float, int]:
        if self._current is None or self._current[0] != micro:
            self.release()  # free the previous model and batches before building the next
            fresh = micro_batches(self.model, micro, self.global_batch // micro, self.device)
            self.adopt(micro, build_loop("gradaccum", self.model, len(fresh), self.device), fresh)
        assert self._current is not None
        _, loop, batches = self._current
        sync = device_sync(self.device)
        sync()
        f0, t0 = minor_faults(), time.perf_counter()
        loop.window(batches)
        sync()
        return time.perf_counter() - t0, minor_faults() - f0


class _ChildTimer:
    """A :class:`_LocalTimer` in a child process started with :data:`TUNED_MALLOC`."""

    def __init__(self, model: str, global_batch: int, device: torch.device) -> None:
        argv = [sys.executable, "-m", "gradaccum.bench.sweep", "--model", model,
                "--global-batch", str(global_batch), "--device", str(device),
                "--threads", str(torch.get_num_threads())]
        self._proc = subprocess.Popen(argv, env={**os.environ, **TUNED_MALLOC}, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def window(self, micro: int) -> tuple[float, int]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(f"{micro}\n")
        self._proc.stdin.flush()
        for line in self._proc.stdout:
            if line.startswith(ANSWER):
                seconds, faults = json.loads(line[len(ANSWER):])
                return float(seconds), int(faults)
        raise RuntimeError(f"the tuned-malloc child exited with {self._proc.wait()}")

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait()


def _time_micro(timers: dict[str, _Timer], micro: int, repeats: int,
                cold: Collection[str]) -> dict[str, WindowTime]:
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in timers}
    for name in cold:  # one untimed window: optimizer state, allocator
        timers[name].window(micro)
    for _ in range(repeats):
        for name, timer in timers.items():
            samples[name].append(timer.window(micro))
    return {name: WindowTime(statistics.median(s for s, _ in values),
                             statistics.fmean(f for _, f in values)) for name, values in samples.items()}


def run_sweep(sizes: Sizes, device: torch.device, malloc_compare: bool = True) -> list[SweepRow]:
    """Section b: allocator peak, floor and time per window at every micro-batch of the sweep.

    The memory measurement's window is also this process's warm-up window at that micro-batch.

    Args:
        sizes: the model, global batch and micro-batches.
        device: where it trains.
        malloc_compare: also time every window in a child process with :data:`TUNED_MALLOC`,
            interleaved with this process's (CPU only: the variables change glibc's malloc).
    """
    model, glob = sizes.sweep_model, sizes.global_batch
    local = _LocalTimer(model, glob, device)
    timers: dict[str, _Timer] = {"launched": local}
    child = _ChildTimer(model, glob, device) if malloc_compare and device.type == "cpu" else None
    if child is not None:
        timers["tuned"] = child
    rows = []
    try:
        for micro in sizes.sweep:
            local.release()
            batches = micro_batches(model, micro, glob // micro, device)
            loop, memory = window_memory("gradaccum", model, batches, device)
            local.adopt(micro, loop, batches)
            times = _time_micro(timers, micro, sizes.sweep_repeats, cold=["tuned"] if child else [])
            rows.append(SweepRow(model, micro, glob // micro, memory.peak,
                                 floor_bytes(loop.model, loop.optimizer),
                                 times["launched"], times.get("tuned")))
    finally:
        local.release()
        if child is not None:
            child.close()
    return rows


def _serve() -> None:
    parser = argparse.ArgumentParser(description="time gradaccum windows for micro-batches read on stdin")
    parser.add_argument("--model", required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    timer = _LocalTimer(args.model, args.global_batch, torch.device(args.device))
    for line in sys.stdin:
        print(ANSWER + json.dumps(timer.window(int(line))), flush=True)


if __name__ == "__main__":
    _serve()
