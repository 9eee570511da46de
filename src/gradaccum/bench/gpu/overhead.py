"""Check 1, overhead: gradaccum against nanoGPT's hand-written loop, same model and batches.

Both train a copy of the ~100 M parameter GPT (:data:`~gradaccum.bench.gpu.gpt.GPT_100M`) with
fused AdamW under bf16 autocast, N micro-batches per window, the window's gradient clipped to 1.0:

* ``hand-written``: nanoGPT's ``train.py`` micro-step loop: ``loss / N``, backward; then
  ``clip_grad_norm_``, ``step``, ``zero_grad(set_to_none=True)``;
* ``gradaccum``: ``Accumulator(opt, N, model=model, clip_norm=1.0)``, ``acc.backward(loss)``.

Timed with CUDA events around each window, in rounds whose order alternates (A B, B A, ...),
until the time box is nearly spent; the ratio is of the medians. Memory: the peak of one window
(``max_memory_allocated`` above what is allocated before it), each contender measured alone;
gradaccum may hold the window's micro-batch losses beyond the hand loop (``LOSS_BLOCKS``).
The smoke times with the wall clock (the CPU has no events) and judges nothing: a tiny model on
a CPU says nothing about a GPU's overhead.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gradaccum import Accumulator
from gradaccum.bench.gpu.check import Context, Outcome, peak
from gradaccum.bench.gpu.gpt import GPT_100M, GPT_TINY, gpt_loss, token_batches
from gradaccum.bench.measure import Timings
from gradaccum.demos.gpt import GPT, GPTConfig

__all__ = ["EventClock", "WallClock", "run"]

RATIO_TARGET = 1.01
STEPS = 4  # micro-batches per window
# What gradaccum holds beyond the hand loop: the window's detached micro-batch losses (for
# acc.window_loss without a host sync), one 0-dim tensor each, a 512-byte allocator block on CUDA.
LOSS_BLOCKS = STEPS * 512
Batches = list[tuple[torch.Tensor, torch.Tensor]]


class EventClock:
    """Times GPU work with CUDA events: marks are recorded on the stream, read after a sync."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0


class WallClock:
    """The smoke's clock (the CPU runs its work before returning): ``time.perf_counter``."""

    def mark(self) -> Any:
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)


def _micro_batch(device: torch.device) -> int:
    """Sequences of 1,024 tokens per micro-batch: enough to keep a large GPU busy, and to fit."""
    if device.type != "cuda":
        return 2
    gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    return 16 if gib >= 40 else 8 if gib >= 20 else 4


def _contenders(config: GPTConfig, device: torch.device) -> tuple[dict[str, Callable[[Batches], None]], int]:
    """Both loops, each with its own copy of one GPT, and that GPT's parameter count."""
    torch.manual_seed(0)
    base = GPT(config).to(device)
    cuda = device.type == "cuda"

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(base)
        return model, torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95),
                                        weight_decay=0.1, fused=cuda)

    hw_model, hw_opt = build()
    ga_model, ga_opt = build()
    acc = Accumulator(ga_opt, STEPS, model=ga_model, clip_norm=1.0)

    def autocast() -> torch.autocast:
        return torch.autocast(device.type, dtype=torch.bfloat16)

    def hand_written(batches: Batches) -> None:
        for x, y in batches:
            with autocast():
                loss = gpt_loss(hw_model(x)[0], y) / STEPS
            torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(hw_model.parameters(), 1.0)
        hw_opt.step()
        hw_opt.zero_grad(set_to_none=True)

    def gradaccum(batches: Batches) -> None:
        for x, y in batches:
            with autocast():
                loss = gpt_loss(ga_model(x)[0], y)
            acc.backward(loss)

    return {"hand-written": hand_written, "gradaccum": gradaccum}, sum(p.numel() for p in base.parameters())


def _timed_rounds(ctx: Context, fns: dict[str, Callable[[Batches], None]], batches: Batches,
                  max_rounds: int) -> Timings:
    clock = EventClock() if ctx.device.type == "cuda" else WallClock()
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    round_seconds = 0.0
    for r in range(max_rounds):
        if r >= 3 and ctx.time_left() < 2 * round_seconds + 15:  # keep time for the memory part
            break
        began = time.time()
        order = names if r % 2 == 0 else names[::-1]
        marks = []
        for name in order:
            start = clock.mark()
            fns[name](batches)
            marks.append((name, start, clock.mark()))
        for name, start, end in marks:
            samples[name].append(clock.seconds(start, end))
        round_seconds = time.time() - began
        ctx.record(rounds=r + 1, seconds_per_window=samples)
    return Timings(samples)


def run(ctx: Context) -> Outcome:
    """Time and measure both loops; the outcome's ``met`` is judged on CUDA only."""
    config = GPT_TINY if ctx.smoke else GPT_100M
    micro = _micro_batch(ctx.device)
    fns, n_params = _contenders(config, ctx.device)
    batches = token_batches(config, micro, STEPS, ctx.device)
    ctx.record(model=config.__dict__, parameters=n_params, micro_batch=micro, steps=STEPS,
               tokens_per_window=micro * STEPS * config.block_size, clock="cuda events" if not ctx.smoke
               else "wall clock (smoke)")
    for _ in range(2):  # warm-up: optimizer state, cuBLAS handles, autotuning
        for fn in fns.values():
            fn(batches)
    timings = _timed_rounds(ctx, fns, batches, max_rounds=4 if ctx.smoke else 60)
    ratio = timings.ratio("gradaccum", "hand-written")
    quartiles = timings.paired_quartiles("gradaccum", "hand-written")
    peaks = {}
    for name in ("hand-written", "gradaccum", "hand-written", "gradaccum"):  # the second pair counts
        fn = fns[name]
        peaks[name] = peak(lambda: fn(batches), ctx.device).peak  # noqa: B023 (called at once)
    diff = peaks["gradaccum"] - peaks["hand-written"]
    ms = {n: 1000 * timings.median(n) for n in fns}
    ctx.record(median_ms=ms, ratio=ratio, ratio_quartiles=quartiles, peak_bytes=peaks,
               peak_diff_bytes=diff, stdev_ms={n: 1000 * statistics.pstdev(s)
                                               for n, s in timings.samples.items()})
    measured = (f"{micro} x {STEPS} sequences of {config.block_size}: {ms['gradaccum']:.1f} vs "
                f"{ms['hand-written']:.1f} ms/window, ratio {ratio:.3f} [{quartiles[0]:.3f}, "
                f"{quartiles[1]:.3f}], {len(timings.samples['gradaccum'])} rounds; peak diff {diff:+,} B")
    met = None if ctx.smoke else ratio <= RATIO_TARGET and diff <= LOSS_BLOCKS
    return Outcome(measured, f"ratio <= {RATIO_TARGET}, peak diff <= {LOSS_BLOCKS:,} B", met)
