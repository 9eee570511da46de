"""Render docs/BATCHNORM.md from the numbers of batchnorm_experiment.py (kept apart for length)."""

from __future__ import annotations

from typing import Any

TOOLS = [
    ["`scale_momentum_(model, N, \"compound\")`",
     "N updates decay the running statistics like one: `m' = 1 - (1 - m)^(1/N)`",
     "the decay, yes; the statistics are still micro-batch ones"],
    ["`scale_momentum_(model, N, \"linear\")`", "`m' = m / N` (Composer's ghost BatchNorm)",
     "a first-order approximation of the compound rule"],
    ["`window_batchnorm(model, accumulator)`",
     "running statistics updated once per window from the pooled count, mean and squared "
     "deviations: one forward of the whole batch (unbiased variance, `num_batches_tracked` +1 per "
     "window, `momentum=None` too; `sync=True` pools over DDP ranks)",
     "yes, each layer's running statistics given its inputs (tested to 1e-10 in float64)"],
    ["`to_groupnorm(model)`", "no batch dependence at all: accumulation exact for the whole model",
     "yes, but it is another layer: train it anew"],
]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def _dist(values: list[float]) -> str:
    return f"{values[-1]:.2e}" if values else "n/a (no running statistics)"


def render(results: dict[str, Any], png: str) -> str:
    """The whole document, from the results dict."""
    s, runs, part_b = results["settings"], results["runs"], results["restimate"]
    machine = "\n".join(f"| {k} | {v} |" for k, v in results["machine"].items())
    epochs = s["epochs"]
    train_rows = [[r["name"], *(f"{a:.2f}" for a in r["accuracy"]), f"{r['train_loss'][-1]:.4f}",
                   _dist(r["mean_distance"]) if i else "0 (itself)",
                   _dist(r["var_distance"]) if i else "0 (itself)",
                   f"{sum(r['seconds']) / len(r['seconds']):.0f}"]
                  for i, r in enumerate(runs)]
    train_header = ["variant", *(f"test acc. epoch {e + 1} (%)" for e in range(epochs)),
                    f"train loss epoch {epochs}", "running_mean distance", "running_var distance",
                    "s / epoch"]
    n_layers = len(part_b[0]["mean_distance"])
    b_header = ["treatment", *(f"BN{i + 1} {what} distance" for i in range(n_layers)
                               for what in ("running_mean", "running_var")), "test acc. (%)"]
    b_rows = [[r["name"], *(f"{d:.1e}" for pair in zip(r["mean_distance"], r["var_distance"], strict=True)
                            for d in pair), f"{r['accuracy']:.2f}"] for r in part_b]
    return f"""# BatchNorm under gradient accumulation

A BatchNorm layer depends on the batch: under accumulation it sees micro-batches. In training it
normalizes each micro-batch by the micro-batch's own mean and variance, and it updates its running
statistics (which evaluation uses) once per micro-batch, N times per optimizer step. gradaccum offers
four tools, each reversible (`gradaccum.restore_batchnorm`, `gradaccum.restore_momentum_`), all
available as `gradaccum train --bn compound|linear|window|groupnorm`:

{_table(["tool", "what it fixes", "exact?"], TOOLS)}

What no tool can make exact: the *training-time* normalization of each micro-batch by its own
statistics (window BatchNorm keeps it; only GroupNorm removes it). The gradients of a 16x16 run
therefore differ from the 256x1 run's; the experiment below measures by how much it matters.

## Experiment

The demo's `cnn-bn` model (two conv blocks with BatchNorm2d, 16 and 32 channels) on MNIST, global
batch 256: the reference 256x1 against 16 micro-batches of 16. SGD (lr {s['lr']}, momentum 0.9),
{epochs} epochs of {s['windows_per_epoch']} optimizer steps ({s['train_items']} training images, the last
partial batch dropped), seed {s['seed']}: the same initial weights and the same data order for every
variant. GroupNorm uses `to_groupnorm`'s default groups (16 and 32: one channel per group here).
Test accuracy is measured in eval mode, on the {s['test_items']:,} test images.

Reproduce (writes this file, `{png}` and `batchnorm_results.json`):

    {s['command']}

It took {s['total_seconds'] / 60:.0f} minutes on the machine below with {s['threads']} torch thread
(the machine was shared with other jobs: the seconds are not a benchmark).

### A. Training: accuracy and distance of the running statistics to the reference run's

Distances are relative L2 distances, `||s - s_ref|| / ||s_ref||`, over all BatchNorm channels, of
each run's running mean (variance) to the 256x1 run's at the end of training. They mix two
effects: the statistics estimate and the weights, which drift apart as the runs train differently.

{_table(train_header, train_rows)}

![BatchNorm under accumulation]({png})

### B. The statistics alone: same weights, running statistics re-estimated

The trained 256x1 weights; running statistics reset, then re-estimated by {s['stats_windows']} windows
of training-mode forwards (no weight change) under each treatment; distance to the 256x1 estimate
and the test accuracy with those statistics.

{_table(b_header, b_rows)}

## Recommendation

{results.get('recommendation', 'RECOMMENDATION')}

## Machine

| key | value |
|---|---|
{machine}
"""
