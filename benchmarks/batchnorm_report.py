"""Render docs/BATCHNORM.md from the numbers of batchnorm_experiment.py (kept apart for length).

Every number the page states is written as ``[[key|format]]`` in the templates below, then
formatted from the results and listed, in reading order, in its part's ``<!-- results: ... -->``
marker (tests/test_doc_numbers.py reads the page against the file). Numbers derived from the
results (a ratio, a spread) are added to the results under ``derived`` first.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

RESULTS = "docs/batchnorm_results.json"
PLACE = re.compile(r"\[\[([^|\]]+)\|([^\]]*)\]\]")


def _get(data: Any, key: str) -> Any:
    scale = re.match(r"^(.*)/(\d+)$", key)
    path, factor = (scale.group(1), int(scale.group(2))) if scale else (key, 1)
    for part in path.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data / factor if scale else data


def _bound(template: str, results: dict[str, Any]) -> tuple[str, list[str]]:
    """The template with each ``[[key|format]]`` formatted from ``results``, and the keys in order."""
    keys: list[str] = []

    def fill(match: re.Match[str]) -> str:
        keys.append(match.group(1))
        return format(_get(results, match.group(1)), match.group(2))

    return PLACE.sub(fill, template), keys


def _marked(template: str, results: dict[str, Any]) -> str:
    """A part of the page between its results marker and ``<!-- /results -->``."""
    return _marker(*_bound(template, results))


def _marker(text: str, keys: list[str]) -> str:
    lines = textwrap.wrap(" ".join(keys), 100, break_on_hyphens=False)
    return "\n".join([f"<!-- results: {RESULTS}", *lines, "-->", text, "<!-- /results -->"])


def derive(results: dict[str, Any]) -> dict[str, Any]:
    """The numbers the recommendation derives from the runs, kept in the results as ``derived``."""
    runs = {r["bn"] if i else "reference": r for i, r in enumerate(results["runs"])}
    accs = [runs[k]["accuracy"][-1] for k in ("plain", "compound", "linear", "window")]
    part_b = {r["name"]: r for r in results["restimate"]}
    plain, compound = part_b["16x16 plain BN"], part_b["16x16 compound momentum"]
    return {"bn_accuracy_min": min(accs), "bn_accuracy_max": max(accs),
            "bn_accuracy_spread": max(accs) - min(accs),
            "plain_over_compound_mean_distance": plain["mean_distance"][0] / compound["mean_distance"][0]}

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


def _gap_before(results: dict[str, Any]) -> str:
    """How the 256x1 / window-BN accuracy gap stood after the second epoch, said as measured."""
    ref, window = (results["runs"][i]["accuracy"] for i in (0, 4))
    if len(ref) < 3:  # a run of one or two epochs has no earlier epoch to set beside the last
        return ""
    same_side = (ref[-1] - window[-1]) * (ref[1] - window[1]) > 0
    return (", and it " + ("stood the same way" if same_side else "was reversed") + " after the "
            "second epoch ([[runs.0.accuracy.1|.2f]]% against [[runs.4.accuracy.1|.2f]]%)")


def _recommendation(results: dict[str, Any]) -> tuple[str, list[str]]:
    """The advice, each number a placeholder bound to the results (runs by index: 0 the 256x1
    reference, 1 plain, 2 compound, 3 linear, 4 window, 5 GroupNorm; part B likewise, 0 to 4)."""
    def first(i: int) -> str:  # part B, first layer: mean / var distance
        return f"[[restimate.{i}.mean_distance.0|.0e]] / [[restimate.{i}.var_distance.0|.0e]]"

    def early(i: int) -> str:  # part A, running_var distance at the first recorded step
        return f"[[runs.{i}.var_distance.0|.0e]]"

    step = "[[runs.0.trace_steps.0|]]"
    items = [
        "**For accuracy on this model, plain BatchNorm is fine.** The four 16x16 BatchNorm treatments "
        "train the same weights and end within [[derived.bn_accuracy_spread|.2f]] points of each other "
        "([[derived.bn_accuracy_min|.2f]] to [[derived.bn_accuracy_max|.2f]]%, a few of the "
        "[[settings.test_items|,]] test images). In part B, plain BN's first-layer running mean is "
        "[[derived.plain_over_compound_mean_distance|.0f]] times further from the full batch's than "
        f"under the compound rule (mean / var distances {first(1)} against {first(2)}), and still gives "
        "[[restimate.1.accuracy|.2f]]% against [[restimate.4.accuracy|.2f]]%.",
        "**When the running statistics must match the large-batch run** (evaluating early in "
        "training, reproducing or comparing with a 256x1 baseline, exporting a model whose eval "
        "statistics matter), **use `window_batchnorm`**: exact for a layer whose input does not pass "
        f"through an earlier BatchNorm (part B, first layer: {first(4)}, float32 rounding), no "
        f"extra pass over the activations, and pooled across DDP ranks with `sync=True`. At step {step} "
        f"of training its running variance was {early(4)} from the reference run's, plain BN's "
        f"{early(1)}.",
        "**The compound momentum rule is the simplest alternative** (no layer swapped, nothing to "
        f"commit, no Accumulator needed) and lands close to window BN (part B: {first(2)}; "
        f"step {step}: {early(2)}). The linear rule is close here as well (part B: "
        f"{first(3)}; step {step}: {early(3)}), but it forgets the old statistics more "
        "slowly than one full step does.",
        "**No running-statistics treatment changes training.** Layers after the first see inputs "
        "normalized by micro-batch statistics: in part B window BN and both momentum rules sit at the "
        "same [[restimate.4.var_distance.1|.0e]] running_var distance on the second layer, and the "
        "16x16 weights differ from the 256x1 weights for the same reason. The accuracy gap that leaves "
        "([[runs.0.accuracy.-1|.2f]]% for 256x1 against [[runs.4.accuracy.-1|.2f]]% after "
        "[[settings.epochs|]] epochs) is one seed's" + _gap_before(results) + ".",
        "**GroupNorm** is the one choice that makes accumulation exact for the whole model (any split of "
        "the batch gives the same gradients), but it is another model, to train and tune as such: here "
        + ", ".join(f"[[runs.5.accuracy.{e}|.2f]]" for e in range(len(results["runs"][5]["accuracy"])))
        + "% after each of the [[settings.epochs|]] epochs with the "
        "BatchNorm model's learning rate. Choose it when training from scratch with micro-batches so "
        "small that batch statistics mean little, not to fix a trained BatchNorm model.",
    ]
    filled = [_bound(item, results) for item in items]  # formatted first, then wrapped
    text = "\n".join(textwrap.fill(t, 100, initial_indent=f"{i}. ", subsequent_indent="   ")
                     for i, (t, _) in enumerate(filled, 1))
    return text, [k for _, keys in filled for k in keys]


def _cells(i: int, r: dict[str, Any]) -> list[str]:
    k = f"runs.{i}"
    acc = [f"[[{k}.accuracy.{e}|.2f]]" for e in range(len(r["accuracy"]))]
    if i == 0:
        dist = [f"[[{k}.mean_distance.0|g]]", f"[[{k}.var_distance.0|g]]"]  # the reference: 0
    elif r["mean_distance"]:
        dist = [f"[[{k}.{d}.0|.1e]] / [[{k}.{d}.-1|.1e]]" for d in ("mean_distance", "var_distance")]
    else:
        dist = ["n/a (no running statistics)"] * 2
    return [r["name"], *acc, f"[[{k}.train_loss.-1|.4f]]", *dist, f"[[{k}.seconds_per_epoch|.0f]]"]


def render(results: dict[str, Any], png: str) -> str:
    """The whole document, from the results dict (with its ``derived`` numbers)."""
    s, runs, part_b = results["settings"], results["runs"], results["restimate"]
    machine = "\n".join(f"| {k} | {v if k in ('cpu_count', 'torch_threads') else f'`{v}`'} |"
                        for k, v in results["machine"].items())
    machine_keys = " ".join(f"machine.{k}" for k in ("cpu_count", "torch_threads"))
    epochs = s["epochs"]
    first = runs[0]["trace_steps"][0] if runs[0]["trace_steps"] else 0
    train_rows = [_cells(i, r) for i, r in enumerate(runs)]
    train_header = ["variant", *(f"test acc. epoch {e + 1} (%)" for e in range(epochs)),
                    f"train loss epoch {epochs}", f"running_mean distance, step {first} / end",
                    f"running_var distance, step {first} / end", "s / epoch"]
    n_layers = len(part_b[0]["mean_distance"])
    b_header = ["treatment", *(f"BN{i + 1} {what} distance" for i in range(n_layers)
                               for what in ("running_mean", "running_var")), "test acc. (%)"]
    b_rows = [[r["name"], *(f"[[restimate.{j}.{d}.{i}|.1e]]" for i in range(n_layers)
                            for d in ("mean_distance", "var_distance")), f"[[restimate.{j}.accuracy|.2f]]"]
              for j, r in enumerate(part_b)]
    took = ("It took [[settings.total_seconds/60|.0f]] minutes on the machine below with "
            "[[settings.threads|]] torch thread\n(the machine was shared with other jobs and the load "
            "varied, heaviest during the first runs: the\nseconds per epoch below are not a speed "
            "comparison).")
    took_part = _marked(took, results)
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

{took_part}

### A. Training: accuracy and distance of the running statistics to the reference run's

Distances are relative L2 distances, `||s - s_ref|| / ||s_ref||`, over all BatchNorm channels, of
each run's running mean (variance) to the 256x1 run's, at the first recorded step and at the end.
They mix two effects: the statistics estimate, and the weights, which drift apart as the runs
train differently (each micro-batch is normalized by its own statistics). The four 16x16 BatchNorm
runs train the very same weights (the training forward never reads the running statistics; a
test pins it bitwise), so among them only the running statistics, and with them the eval-mode
accuracy, differ.

{_marked(_table(train_header, train_rows), results)}

![BatchNorm under accumulation]({png})

### B. The statistics alone: same weights, running statistics re-estimated

The trained 256x1 weights; running statistics reset, then re-estimated by {s['stats_windows']} windows
of training-mode forwards (no weight change) under each treatment; distance to the 256x1 estimate
and the test accuracy with those statistics.

{_marked(_table(b_header, b_rows), results)}

## Recommendation

{_marker(*_recommendation(results))}

## Machine

<!-- results: {RESULTS}
{machine_keys}
-->
| key | value |
|---|---|
{machine}
<!-- /results -->
"""
