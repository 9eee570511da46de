"""Check 9, ``backward_cached`` on a CLIP-sized two-tower model in bf16: its peak memory and time
against the full batch (and naive accumulation of the same chunks).

:data:`~gradaccum.bench.towers.CLIP_B32` (ViT-B/32's image tower and CLIP's text tower, about
150 M float32 parameters) under bf16 autocast, OpenCLIP's loss with its learnable ``logit_scale``,
one batch of 1,024 pairs (256 on a GPU under 80 GiB) cut into 8 chunks. Three contenders, each one
SGD step (lr 0, so the model does not move; :func:`gradaccum.bench.towers.contenders`): the full
batch, naive accumulation of each chunk's loss, and ``backward_cached`` over the chunks.

* Gradient: relative L2 distance of each contender's gradient from the full batch's. bf16 rounds
  the chunked and the whole batch differently, so ``backward_cached`` is not bitwise the full
  batch; it must be closer than naive accumulation, which optimizes another objective.
* Memory: each contender's peak (``max_memory_allocated`` above what was allocated before it),
  measured alone after a warm-up step.
* Time: rounds of the three in rotating order (wall clock after a device sync), until the time box
  nears its end; medians, and ``backward_cached`` over naive accumulation.

Targets: a peak at most half the full batch's; a gradient closer to the full batch's than naive
accumulation's; on CUDA, at most 1.5x naive accumulation's time (the smoke does not judge time).
"""

from __future__ import annotations

import torch

from gradaccum.bench.gpu.check import Context, Outcome, peak, rel_l2, size_text
from gradaccum.bench.measure import device_sync, interleaved, step_grads
from gradaccum.bench.towers import CLIP_B32, TOWERS_TINY, TwoTowers, contenders, pair_batch

__all__ = ["run"]

PIECES = 8
TIME_TARGET = 1.5
PEAK_TARGET = 0.5


def _pairs(ctx: Context) -> int:
    if ctx.smoke:
        return 64
    gib = torch.cuda.get_device_properties(ctx.device).total_memory / 2**30
    return 1024 if gib >= 80 else 256


def run(ctx: Context) -> Outcome:
    """Gradients, peaks and times of the three contenders; ``met`` as the module says."""
    sizes = TOWERS_TINY if ctx.smoke else CLIP_B32
    pairs = _pairs(ctx)
    torch.manual_seed(0)
    model = TwoTowers(sizes).to(ctx.device)
    batch = pair_batch(sizes, pairs, ctx.device)
    n_params = sum(p.numel() for p in model.parameters())
    ctx.record(sizes=sizes.__dict__, parameters=n_params, pairs=pairs, chunks=PIECES, autocast="bfloat16")
    fns = contenders(model, batch, PIECES, autocast=torch.bfloat16)
    grads = {name: step_grads(model, fn) for name, fn in fns.items()}
    errors = {name: rel_l2(g, grads["full batch"]) for name, g in grads.items() if name != "full batch"}
    ctx.record(relative_l2_from_full_batch=errors)
    del grads
    peaks = {}
    for name, fn in fns.items():
        fn()  # warm-up, then alone under the peak counter
        peaks[name] = peak(fn, ctx.device).peak
    ctx.record(peak_bytes=peaks)
    sync = device_sync(ctx.device)
    one = interleaved(fns, repeats=1, calls=1, sync=sync, warmup=False)
    round_s = sum(one.median(n) for n in fns)
    repeats = 3 if ctx.smoke else max(3, min(15, int((ctx.time_left() - 5) / max(round_s, 1e-3))))
    timings = interleaved(fns, repeats=repeats, calls=1, sync=sync, warmup=False)
    ms = {n: 1000 * timings.median(n) for n in fns}
    vs_naive = timings.ratio("backward_cached", "naive")
    vs_full = timings.ratio("backward_cached", "full batch")
    peak_ratio = peaks["backward_cached"] / peaks["full batch"]
    ctx.record(median_ms=ms, rounds=repeats, time_vs_naive=vs_naive, time_vs_full_batch=vs_full,
               peak_vs_full_batch=peak_ratio)
    measured = (f"{pairs} pairs in {PIECES} chunks, {n_params:,} parameters: peak "
                f"{size_text(peaks['backward_cached'])} vs full batch {size_text(peaks['full batch'])} "
                f"({peak_ratio:.2f}x), naive {size_text(peaks['naive'])}; "
                f"time {ms['backward_cached']:.0f} ms "
                f"= {vs_full:.2f}x full batch, {vs_naive:.2f}x naive; gradient rel. L2 from full batch "
                f"{errors['backward_cached']:.1e} (naive {errors['naive']:.1e})")
    met = (peak_ratio <= PEAK_TARGET and errors["backward_cached"] < errors["naive"]
           and (ctx.smoke or vs_naive <= TIME_TARGET))
    return Outcome(measured, f"peak <= {PEAK_TARGET}x full batch; gradient closer than naive; time <= "
                   f"{TIME_TARGET}x naive (CUDA)", met)
