"""Check 5, planner: ``gradaccum plan``'s predicted peak against the peak of real training.

The prediction is ``estimate_memory`` (what ``gradaccum plan`` runs: probe windows at its default
micro-batch sizes 2, 4, 8 and 16, the least-squares line through their peaks) on the benchmark CNN
with Adam in float32. The
measurement is independent of the probes: a fresh model trained by an ``Accumulator`` (4
micro-batches per window, cross-entropy on random labels), one warm-up window at micro-batch 1
(the optimizer's state), then one window at the size; its peak is ``max_memory_allocated``
(everything this process holds on the GPU, as the planner counts it). Three sizes the probes did
not use; the target is within 5% at each.

The smoke runs the same code on the MNIST CNN on the CPU, where the peaks are rebuilt from the
profiler's memory events (as ``gradaccum plan`` does there).
"""

from __future__ import annotations

import gc

import torch

from gradaccum import Accumulator
from gradaccum.bench.gpu.check import Context, Outcome, peak
from gradaccum.core.memory import format_bytes
from gradaccum.demos.models import MODELS, build_model
from gradaccum.torch.memory.probe import estimate_memory

__all__ = ["run", "training_peak"]

TOLERANCE = 0.05
STEPS = 4


def _fresh(ctx: Context, name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(name, seed=0).to(ctx.device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def training_peak(ctx: Context, name: str, micro: int) -> int:
    """The peak bytes of training ``name`` at ``micro`` (after a warm-up window), all it holds."""
    shape = MODELS[name][1]
    g = torch.Generator().manual_seed(micro)

    def train() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model, opt = _fresh(ctx, name)
        acc = Accumulator(opt, STEPS, model=model)
        for m in (1, micro):
            for _ in range(STEPS):
                x = torch.randn(m, *shape, generator=g).to(ctx.device)
                y = torch.randint(0, 10, (m,), generator=g).to(ctx.device)
                acc.backward(torch.nn.functional.cross_entropy(model(x), y))
        return model, opt

    gc.collect()
    base = torch.cuda.memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0
    return base + peak(train, ctx.device).peak


def run(ctx: Context) -> Outcome:
    """Predict with the planner, then measure three sizes the probes did not use."""
    name = "cnn" if ctx.smoke else "bench-cnn"
    sizes = (24, 32, 48) if ctx.smoke else (32, 96, 256)
    model, opt = _fresh(ctx, name)
    est = estimate_memory(model, opt, MODELS[name][1])  # gradaccum plan's default probes
    del model, opt  # the measurements start from an empty device
    ctx.record(model=name, optimizer="adam", probes=est.probes, steps=STEPS,
               estimate={"param_bytes": est.param_bytes, "grad_bytes": est.grad_bytes,
                         "optimizer_bytes": est.optimizer_bytes,
                         "activation_bytes_per_sample": est.activation_bytes_per_sample,
                         "overhead_bytes": est.overhead_bytes, "update_peak_bytes": est.update_peak_bytes})
    rows = {}
    for m in sizes:
        measured = training_peak(ctx, name, m)
        predicted = est.peak(m)
        rows[m] = {"predicted": predicted, "measured": measured,
                   "error": (predicted - measured) / measured}
        ctx.record(sizes=rows)
    text = ", ".join(f"{m}: {format_bytes(r['predicted'])} vs {format_bytes(r['measured'])} "
                     f"({100 * r['error']:+.1f}%)" for m, r in rows.items())
    met = all(abs(r["error"]) <= TOLERANCE for r in rows.values())
    return Outcome(f"{name}, probes {','.join(map(str, est.probes))}: {text}",
                   f"within {100 * TOLERANCE:.0f}% at each size", met)
