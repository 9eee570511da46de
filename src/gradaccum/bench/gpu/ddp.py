"""Check 8, DDP: two processes on the one GPU over gloo; one gradient all-reduce per window, and
the parameters of a one-process run on the whole global batch.

NCCL needs one GPU per rank; gloo reduces CUDA tensors through the host, so two ranks can share
one GPU. Each rank (:mod:`gradaccum.bench.gpu.ddp_rank`, forked here)
trains 3 windows of 3 micro-batches of a float64 GPT, with mean weighting and with ``n_items``.
Targets: the gradient all-reduces (a DDP comm hook; one bucket) grow by exactly one at each
boundary and by none off it, and every rank's parameters equal the one-process reference to
float64 rounding (max |diff| <= 1e-12). Also counted: the Accumulator's own all-reduces (the
window's loss and item total, one per window). The smoke runs the same two ranks on the CPU.
"""

from __future__ import annotations

import json
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gradaccum.bench.gpu.check import Context, Outcome
from gradaccum.bench.gpu.ddp_rank import STEPS, WINDOWS, rank_main
from gradaccum.torch.check.spawn import free_port

__all__ = ["launch", "run"]

WORLD = 2
TOLERANCE = 1e-12


def launch(out: Path, device: str, timeout_s: float) -> list[dict[str, Any]]:
    """Run :func:`~gradaccum.bench.gpu.ddp_rank.rank_main` on WORLD local ranks; their results.

    The ranks are forked (torch is imported already: no start-up cost), which CUDA allows only
    from a process that has not used it yet: this one has not.

    Raises:
        RuntimeError: CUDA is initialized here, a rank failed, or they outlived ``timeout_s``
            (then all are killed); the message holds the end of each failed rank's log.
    """
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise RuntimeError("the DDP check must fork its ranks before this process uses CUDA")
    context = multiprocessing.get_context("fork")
    port = free_port()
    procs = [context.Process(target=rank_main, args=(out, device, rank, WORLD, port), name=f"rank{rank}")
             for rank in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        logs = "\n".join(f"--- rank {r} (exit {procs[r].exitcode})\n"
                         + (out / f"rank{r}.log").read_text(errors="replace")[-3000:] for r in failed)
        raise RuntimeError(f"DDP rank(s) {failed} failed or ran past {timeout_s:.0f} s\n{logs}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _per_window(calls: list[list[int]], which: int) -> tuple[list[int], int]:
    """All-reduces added at each boundary, and the most any off-boundary micro-step added."""
    added = [c[which] - (calls[i - 1][which] if i else 0) for i, c in enumerate(calls)]
    boundaries = [a for i, a in enumerate(added) if i % STEPS == STEPS - 1]
    off = max((a for i, a in enumerate(added) if i % STEPS != STEPS - 1), default=0)
    return boundaries, off


def run(ctx: Context) -> Outcome:
    """Launch the ranks, then judge counts and parameters."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_ddp_") as tmp:
        ranks = launch(Path(tmp), ctx.device.type, max(10.0, ctx.time_left()))
    summary: dict[str, Any] = {}
    ok = True
    for weighting in ("mean", "n_items"):
        results = [r[weighting] for r in ranks]
        grads = [_per_window(r["calls"], 0) for r in results]
        others = [_per_window(r["calls"], 1) for r in results]
        diff = max(r["max_abs_param_diff"] for r in results)
        summary[weighting] = {"grad_all_reduces_per_window": [g[0] for g in grads],
                              "grad_all_reduces_off_boundary": max(g[1] for g in grads),
                              "accumulator_all_reduces_per_window": [o[0] for o in others],
                              "max_abs_param_diff": diff, "ranks": results}
        ok = ok and all(g == ([1] * WINDOWS, 0) for g in grads) and diff <= TOLERANCE
        ok = ok and all(r["optimizer_steps"] == WINDOWS for r in results)
    ctx.record(world=WORLD, steps=STEPS, windows=WINDOWS, backend="gloo", **summary)
    parts = []
    for weighting, s in summary.items():
        per = s["grad_all_reduces_per_window"][0]
        own = s["accumulator_all_reduces_per_window"][0]
        parts.append(f"{weighting}: grad all-reduces per window {per}, off-boundary "
                     f"{s['grad_all_reduces_off_boundary']}, own {own}; "
                     f"max |diff| vs 1 process {s['max_abs_param_diff']:.1e}")
    return Outcome("; ".join(parts), f"1 grad all-reduce per window, 0 off it; diff <= {TOLERANCE:.0e}", ok)
