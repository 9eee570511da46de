"""Render docs/BATCHNORM.md from the numbers of batchnorm_experiment.py (kept apart for length)."""

from __future__ import annotations

import textwrap
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


def _early_late(values: list[float]) -> str:
    return f"{values[0]:.1e} / {values[-1]:.1e}" if values else "n/a (no running statistics)"


def _recommendation(results: dict[str, Any]) -> str:
    """The advice, with its numbers taken from this run's results."""
    a = {r["bn"] if i else "reference": r for i, r in enumerate(results["runs"])}
    b = {r["name"].split()[-2] if "momentum" in r["name"] else r["name"].split()[1]: r
         for r in results["restimate"]}
    accs = [a[k]["accuracy"][-1] for k in ("plain", "compound", "linear", "window")]
    step = a["reference"]["trace_steps"][0]
    ratio = b["plain"]["mean_distance"][0] / b["compound"]["mean_distance"][0]
    e = len(a["window"]["accuracy"])

    def first(mode: str) -> str:  # part B, first layer: mean / var distance
        return f"{b[mode]['mean_distance'][0]:.0e} / {b[mode]['var_distance'][0]:.0e}"

    def early(mode: str) -> str:  # part A, running_var distance at the first recorded step
        return f"{a[mode]['var_distance'][0]:.0e}"

    items = [
        f"**For accuracy on this model, plain BatchNorm is fine.** The four 16x16 BatchNorm treatments "
        f"train the same weights and end within {max(accs) - min(accs):.2f} points of each other "
        f"({min(accs):.2f} to {max(accs):.2f}%, a few of the 10,000 test images). In part B, plain BN's "
        f"first-layer running mean is {ratio:.0f} times further from the full batch's than under the "
        f"compound rule (mean / var distances "
        f"{first('plain')} against {first('compound')}), and still gives "
        f"{b['plain']['accuracy']:.2f}% against {b['window']['accuracy']:.2f}%.",
        f"**When the running statistics must match the large-batch run** (evaluating early in "
        f"training, reproducing or comparing with a 256x1 baseline, exporting a model whose eval "
        f"statistics matter), **use `window_batchnorm`**: exact for a layer whose input does not pass "
        f"through an earlier BatchNorm (part B, first layer: {first('window')}, float32 rounding), no "
        f"extra pass over the activations, and pooled across DDP ranks with `sync=True`. At step {step} "
        f"of training its running variance was {early('window')} from the reference run's, plain BN's "
        f"{early('plain')}.",
        f"**The compound momentum rule is the simplest alternative** (no layer swapped, nothing to "
        f"commit, no Accumulator needed) and lands close to window BN (part B: {first('compound')}; "
        f"step {step}: {early('compound')}). The linear rule is close at N = 16 as well (part B: "
        f"{first('linear')}; step {step}: {early('linear')}), but it forgets the old statistics more "
        f"slowly than one full step does.",
        f"**No running-statistics treatment changes training.** Layers after the first see inputs "
        f"normalized by micro-batch statistics: in part B window BN and both momentum rules sit at the "
        f"same {b['window']['var_distance'][1]:.0e} running_var distance on the second layer, and the "
        f"16x16 weights differ from the 256x1 weights for the same reason. The accuracy gap that leaves "
        f"({a['reference']['accuracy'][-1]:.2f}% for 256x1 against {a['window']['accuracy'][-1]:.2f}% after "
        f"{e} epochs) is one seed's, and it was reversed after epoch 2 "
        f"({a['reference']['accuracy'][1]:.2f}% against {a['window']['accuracy'][1]:.2f}%).",
        f"**GroupNorm** is the one choice that makes accumulation exact for the whole model (any split of "
        f"the batch gives the same gradients), but it is another model, to train and tune as such: here "
        f"{', '.join(f'{x:.2f}' for x in a['groupnorm']['accuracy'])}% after epochs 1 to {e} with the "
        f"BatchNorm model's learning rate. Choose it when training from scratch with micro-batches so "
        f"small that batch statistics mean little, not to fix a trained BatchNorm model.",
    ]
    return "\n".join(textwrap.fill(text, 100, initial_indent=f"{i}. ", subsequent_indent="   ")
                     for i, text in enumerate(items, 1))


def render(results: dict[str, Any], png: str) -> str:
    """The whole document, from the results dict."""
    s, runs, part_b = results["settings"], results["runs"], results["restimate"]
    machine = "\n".join(f"| {k} | {v} |" for k, v in results["machine"].items())
    epochs = s["epochs"]
    first = runs[0]["trace_steps"][0] if runs[0]["trace_steps"] else 0
    train_rows = [[r["name"], *(f"{a:.2f}" for a in r["accuracy"]), f"{r['train_loss'][-1]:.4f}",
                   *(_early_late(r[k]) if i else "0" for k in ("mean_distance", "var_distance")),
                   f"{r['seconds_per_epoch']:.0f}"]
                  for i, r in enumerate(runs)]
    train_header = ["variant", *(f"test acc. epoch {e + 1} (%)" for e in range(epochs)),
                    f"train loss epoch {epochs}", f"running_mean distance, step {first} / end",
                    f"running_var distance, step {first} / end", "s / epoch"]
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

Limits of window BatchNorm: the pending window statistics are not part of the `state_dict` (the
model's checkpoint stays a BatchNorm's), so a checkpoint taken in the middle of a window resumes
with statistics of that window's remaining micro-batches only; forwards repeated by activation
checkpointing count twice, as they do for a plain BatchNorm; a layer converted from
`SyncBatchNorm` normalizes each micro-batch with its rank's statistics and pools the running
statistics over its group at the boundary. Under DDP without `sync=True`, each rank's statistics are
its own batch's (and DDP's buffer broadcast makes rank 0's win), as with a plain BatchNorm.

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
(the machine was shared with other jobs and the load varied, heaviest during the first runs: the
seconds per epoch below are not a speed comparison).

### A. Training: accuracy and distance of the running statistics to the reference run's

Distances are relative L2 distances, `||s - s_ref|| / ||s_ref||`, over all BatchNorm channels, of
each run's running mean (variance) to the 256x1 run's, at the first recorded step and at the end.
They mix two effects: the statistics estimate, and the weights, which drift apart as the runs
train differently (each micro-batch is normalized by its own statistics). The four 16x16 BatchNorm
runs train the very same weights (the training forward never reads the running statistics; a
test pins it bitwise), so among them only the running statistics, and with them the eval-mode
accuracy, differ.

<!-- results: docs/batchnorm_results.json -->
{_table(train_header, train_rows)}
<!-- /results -->

![BatchNorm under accumulation]({png})

### B. The statistics alone: same weights, running statistics re-estimated

The trained 256x1 weights; running statistics reset, then re-estimated by {s['stats_windows']} windows
of training-mode forwards (no weight change) under each treatment; distance to the 256x1 estimate
and the test accuracy with those statistics.

<!-- results: docs/batchnorm_results.json -->
{_table(b_header, b_rows)}
<!-- /results -->

## Recommendation

{_recommendation(results)}

## Machine

<!-- results: docs/batchnorm_results.json -->
| key | value |
|---|---|
{machine}
<!-- /results -->
"""
