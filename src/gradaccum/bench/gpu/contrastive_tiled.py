"""Check 10, the tiled CLIP loss at 1,048,576 pairs through ``backward_cached`` on one GPU, beside the
dense loss at the largest batch it fits.

:class:`~gradaccum.bench.contrastive_scale.TinyTowers` with ``d = 512`` (small MLPs: the loss is
what grows), bf16 autocast, OpenCLIP's learnable ``logit_scale``, chunks of 16,384 pairs, one
``backward_cached`` step each (an SGD of lr 0):

1. ``dense`` (:func:`gradaccum.bench.towers.clip_loss` on the whole ``B x B`` matrix) at the largest
   power of two whose estimate fits in 60% of the free memory, halved on an OOM until it runs;
2. ``tiled`` (:func:`gradaccum.contrastive.clip_loss`) at that same batch: its gradient against
   the dense one's (relative L2: bf16 rounds the two differently), its peak and time;
3. ``tiled`` at 1,048,576 pairs, unless the time left cannot hold it (the time of step 2 scaled by
   the square of the batch ratio).

Each step's peak is ``max_memory_allocated`` above what was allocated before it; its time is wall
clock after a device sync, reported per pair. Targets: 1,048,576 pairs complete; at the dense
batch, the tiled gradient within 5e-2 of the dense one's. The smoke: 1,024 pairs dense, 2,048
tiled, ``d = 16``, chunks of 512, on the CPU (peaks from the process's resident set).
"""

from __future__ import annotations

from typing import Any

import torch

from gradaccum.bench.contrastive_scale import (
    ScaleSizes,
    TinyTowers,
    cached_step,
    dense_estimate,
    pair_features,
    peak_growth,
)
from gradaccum.bench.gpu.check import Context, Outcome, rel_l2, size_text
from gradaccum.bench.measure import step_grads
from gradaccum.torch.memory.oom import is_oom_error, release_memory

__all__ = ["run"]

GPU_PAIRS, SMOKE_PAIRS = 1_048_576, 2048
GPU_SIZES = ScaleSizes(inputs=64, width=512, dim=512, chunk=16384)
SMOKE_SIZES = ScaleSizes(inputs=8, width=16, dim=16, chunk=512)
GRAD_TARGET = 5e-2


def _dense_start(ctx: Context) -> int:
    """The first dense batch to try: the largest power of two whose estimate fits in 60% of the
    free memory (1,024 in the smoke)."""
    if ctx.smoke:
        return 1024
    free, _ = torch.cuda.mem_get_info(ctx.device)
    pairs = 1024
    while dense_estimate(2 * pairs) <= 0.6 * free:
        pairs *= 2
    return pairs


def _step(method: str, model: TinyTowers, pairs: int, sizes: ScaleSizes, ctx: Context) -> dict[str, Any]:
    """One step at ``pairs``: its peak, seconds, time per pair and the gradients."""
    batch = pair_features(pairs, sizes, ctx.device)
    step = cached_step(method, model, batch, sizes.chunk, autocast=torch.bfloat16)
    grads: list[torch.Tensor] = []
    release_memory()
    growth, seconds = peak_growth(lambda: grads.extend(step_grads(model, step)), ctx.device)
    return {"pairs": pairs, "peak_bytes": growth, "seconds": seconds, "ns_per_pair": 1e9 * seconds / pairs,
            "grads": grads}


def _dense(model: TinyTowers, sizes: ScaleSizes, ctx: Context) -> dict[str, Any]:
    """The dense step at the largest batch that runs (halving from :func:`_dense_start` on OOM)."""
    pairs = _dense_start(ctx)
    while True:
        try:
            return _step("dense", model, pairs, sizes, ctx)
        except Exception as e:
            if not is_oom_error(e) or pairs <= 1024:
                raise
            ctx.log(f"dense at {pairs:,} pairs: out of memory; halving")
            pairs //= 2


def run(ctx: Context) -> Outcome:
    """The three steps; ``met`` as the module says."""
    sizes, big = (SMOKE_SIZES, SMOKE_PAIRS) if ctx.smoke else (GPU_SIZES, GPU_PAIRS)
    torch.manual_seed(0)
    model = TinyTowers(sizes).to(ctx.device)
    for method in ("dense", "tiled"):  # warm-up: the kernels' first launches
        _step(method, model, 1024, sizes, ctx)
    ctx.record(sizes=sizes.__dict__, autocast="bfloat16", pairs=big)
    dense = _dense(model, sizes, ctx)
    same = _step("tiled", model, dense["pairs"], sizes, ctx)
    error = rel_l2(same.pop("grads"), dense.pop("grads"))
    ctx.record(dense=dense, tiled_at_dense_pairs=same, grad_rel_l2=error)
    needed = same["seconds"] * (big / same["pairs"]) ** 2
    if needed > 0.8 * ctx.time_left():
        ctx.record(tiled=None, skipped=f"needs about {needed:.0f} s, {ctx.time_left():.0f} s left")
        return Outcome(f"{big:,} pairs skipped: about {needed:.0f} s needed, {ctx.time_left():.0f} s left; "
                       f"dense at {dense['pairs']:,}: {size_text(dense['peak_bytes'])}",
                       f"{big:,} pairs complete; gradient within {GRAD_TARGET} of dense", False)
    tiled = _step("tiled", model, big, sizes, ctx)
    tiled.pop("grads")
    ctx.record(tiled=tiled)
    measured = (f"tiled {big:,} pairs, d {sizes.dim}: peak {size_text(tiled['peak_bytes'])}, "
                f"{tiled['seconds']:.1f} s ({tiled['ns_per_pair']:,.0f} ns/pair); at {dense['pairs']:,} "
                f"pairs: dense {size_text(dense['peak_bytes'])}, {dense['ns_per_pair']:,.0f} ns/pair, tiled "
                f"{size_text(same['peak_bytes'])}, {same['ns_per_pair']:,.0f} ns/pair; gradient rel. L2 "
                f"tiled vs dense {error:.1e}")
    return Outcome(measured, f"{big:,} pairs complete; gradient within {GRAD_TARGET} of dense (rel. L2)",
                   error <= GRAD_TARGET)
