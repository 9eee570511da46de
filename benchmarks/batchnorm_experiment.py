"""BatchNorm under accumulation, measured on MNIST: plain BN, momentum rules, window BN, GroupNorm.

The demo's ``cnn-bn`` model, global batch 256: the full-batch reference (256x1) against 16
micro-batches of 16 (16x16) with plain BatchNorm, the compound and linear momentum rules, window
BatchNorm and GroupNorm. Same seed, same weights, same data order for every variant.

Part A trains each variant and reports test accuracy and the distance of its running statistics
to the reference run's. Part B isolates the statistics: it takes the trained reference weights,
resets the running statistics, and re-estimates them with forwards only (no weight change) under
each treatment, so the distance to the 256x1 estimate comes from the BatchNorm treatment alone.

One command, from the repository root, writes ``docs/BATCHNORM.md``, ``docs/batchnorm.png`` and
the raw numbers ``docs/batchnorm_results.json``::

    PYTHONPATH=src python benchmarks/batchnorm_experiment.py

``--limit-train 2048 --limit-test 1000 --epochs 1 --stats-windows 4 --doc /tmp/BATCHNORM.md
--png /tmp/batchnorm.png --json /tmp/batchnorm_results.json`` gives a smoke run in seconds (its
own paths: the defaults are the committed page and results);
``--render docs/batchnorm_results.json`` rewrites the doc and the plot from saved numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import gradaccum
from gradaccum.bench.machine import describe_machine
from gradaccum.demos.mnist import mnist_tensors
from gradaccum.demos.models import apply_bn_mode, build_model

GLOBAL_BATCH = 256
# name, micro-batch, steps, BatchNorm treatment
VARIANTS = (
    ("256x1 plain BN (reference)", 256, 1, "plain"),
    ("16x16 plain BN", 16, 16, "plain"),
    ("16x16 compound momentum", 16, 16, "compound"),
    ("16x16 linear momentum", 16, 16, "linear"),
    ("16x16 window BN", 16, 16, "window"),
    ("16x16 GroupNorm", 16, 16, "groupnorm"),
)
Data = tuple[torch.Tensor, torch.Tensor]


def bn_stats(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """All BatchNorm layers' running mean and running variance, each concatenated."""
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    if not layers:
        return None
    return (torch.cat([m.running_mean for m in layers]).clone(),  # type: ignore[misc]
            torch.cat([m.running_var for m in layers]).clone())  # type: ignore[misc]


def rel_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return float((a - b).norm() / b.norm())


def windows(n: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """The epoch's global batches of indices: one permutation per (seed, epoch), last partial dropped."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return list(perm[: n - n % GLOBAL_BATCH].split(GLOBAL_BATCH))


@torch.no_grad()
def evaluate(model: nn.Module, test: Data) -> float:
    """Test accuracy in percent, in eval mode (running statistics)."""
    model.eval()
    correct = sum(int((model(xb).argmax(1) == yb).sum()) for xb, yb in zip(*(t.split(1000) for t in test),
                                                                          strict=True))
    return 100.0 * correct / len(test[1])


def train(variant: tuple[str, int, int, str], train_data: Data, test: Data, args: argparse.Namespace
          ) -> tuple[dict[str, Any], nn.Module]:
    """Part A: train one variant; record accuracy per epoch and running statistics every few steps."""
    name, micro, steps, bn = variant
    model = build_model("cnn-bn", seed=args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    acc = gradaccum.Accumulator(opt, steps)
    model = apply_bn_mode(model, bn, acc)
    x, y = train_data
    out: dict[str, Any] = {"name": name, "bn": bn, "accuracy": [], "train_loss": [], "seconds": [],
                           "trace_steps": [], "trace_mean": [], "trace_var": []}
    for epoch in range(args.epochs):
        model.train()
        start, losses = time.perf_counter(), []
        for idx in windows(len(y), args.seed, epoch):
            for xm, ym in zip(x[idx].split(micro), y[idx].split(micro), strict=True):
                acc.backward(F.cross_entropy(model(xm), ym))
            losses.append(float(acc.window_loss))  # type: ignore[arg-type]
            stats = bn_stats(model)
            if stats is not None and acc.optimizer_steps % args.trace_every == 0:
                out["trace_steps"].append(acc.optimizer_steps)
                out["trace_mean"].append(stats[0].tolist())
                out["trace_var"].append(stats[1].tolist())
        out["seconds"].append(time.perf_counter() - start)
        out["train_loss"].append(sum(losses) / len(losses))
        out["accuracy"].append(evaluate(model, test))
        print(f"{name:28s} epoch {epoch + 1}: test {out['accuracy'][-1]:.2f}%  "
              f"loss {out['train_loss'][-1]:.4f}  {out['seconds'][-1]:.0f}s", flush=True)
    out["seconds_per_epoch"] = sum(out["seconds"]) / len(out["seconds"])  # the page cites it
    return out, model


@torch.no_grad()
def restimate(reference: nn.Module, train_data: Data, test: Data, args: argparse.Namespace
              ) -> list[dict[str, Any]]:
    """Part B: the trained reference weights, running statistics reset, re-estimated by forwards."""
    x, y = train_data
    batches = windows(len(y), args.seed, 0)[: args.stats_windows]
    rows = []
    for name, micro, steps, bn in VARIANTS:
        if bn == "groupnorm":
            continue
        model = apply_bn_mode(build_model("cnn-bn"), bn, None, steps=steps)
        model.load_state_dict(reference.state_dict())
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                m.reset_running_stats()
        model.train()
        for idx in batches:
            for xm in x[idx].split(micro):
                model(xm)
            for m in model.modules():  # by hand here: no Accumulator drives these forwards
                if isinstance(m, gradaccum.WindowBatchNorm):
                    m.commit()
        layers = [(m.running_mean.clone(), m.running_var.clone()) for m in model.modules()
                  if isinstance(m, _BatchNorm)]
        rows.append({"name": name, "layers": layers, "accuracy": evaluate(model, test)})
    ref = rows[0]["layers"]
    # Per layer: the first layer's inputs are the same in every treatment, the later layers' are
    # not (the layer before normalized each micro-batch by its own statistics).
    return [{"name": r["name"], "accuracy": r["accuracy"],
             "mean_distance": [rel_distance(m, rm) for (m, _), (rm, _) in zip(r["layers"], ref, strict=True)],
             "var_distance": [rel_distance(v, rv) for (_, v), (_, rv) in zip(r["layers"], ref, strict=True)]}
            for r in rows]


def distances(runs: list[dict[str, Any]]) -> None:
    """Replace each run's statistics trace by its distance to the reference run's at the same
    steps (in place; the raw traces are too large to keep)."""
    ref_mean, ref_var = runs[0]["trace_mean"], runs[0]["trace_var"]
    for run in runs:
        mean, var = run.pop("trace_mean"), run.pop("trace_var")
        run["mean_distance"] = [rel_distance(torch.tensor(a), torch.tensor(b))
                                for a, b in zip(mean, ref_mean, strict=False)]
        run["var_distance"] = [rel_distance(torch.tensor(a), torch.tensor(b))
                               for a, b in zip(var, ref_var, strict=False)]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    # One colour per variant in every panel; dashes show the curves that window BN covers.
    style = {r["name"]: {"color": f"C{i}", "linestyle": "--" if r["bn"] in ("compound", "linear") else "-"}
             for i, r in enumerate(runs)}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for run in sorted(runs[1:], key=lambda r: style[r["name"]]["linestyle"] == "--"):  # dashes on top
        if run["mean_distance"]:
            axes[0].plot(run["trace_steps"], run["mean_distance"], label=run["name"], **style[run["name"]])
            axes[1].plot(run["trace_steps"], run["var_distance"], label=run["name"], **style[run["name"]])
    for ax, what in zip(axes[:2], ("running_mean", "running_var"), strict=True):
        ax.set(yscale="log", xlabel="optimizer step",
               title=f"{what}: relative distance to the 256x1 run")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    epochs = range(1, len(runs[0]["accuracy"]) + 1)
    for run in runs:
        axes[2].plot(epochs, run["accuracy"], marker="o", label=run["name"], **style[run["name"]])
    axes[2].set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy (eval mode)",
                xticks=list(epochs))
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    fig.suptitle("cnn-bn on MNIST, global batch 256: 256x1 reference vs 16 micro-batches of 16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared CPU)")
    p.add_argument("--trace-every", type=int, default=5, help="record statistics every this many steps")
    p.add_argument("--stats-windows", type=int, default=100, help="part B: windows of forwards")
    p.add_argument("--limit-train", type=int, default=None)
    p.add_argument("--limit-test", type=int, default=None)
    p.add_argument("--doc", type=Path, default=Path("docs/BATCHNORM.md"))
    p.add_argument("--png", type=Path, default=Path("docs/batchnorm.png"))
    p.add_argument("--json", type=Path, default=Path("docs/batchnorm_results.json"))
    p.add_argument("--render", type=Path, default=None, help="only rewrite doc and plot from this JSON")
    args = p.parse_args()
    from batchnorm_report import derive, render  # beside this script

    if args.render is not None:
        results = json.loads(args.render.read_text())
    else:
        torch.set_num_threads(args.threads)
        results = run_all(args)
    results["derived"] = derive(results)  # the page's ratios and spreads, bound to keys too
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))

    plot(results, args.png)
    args.doc.write_text(render(results, args.png.name))
    print(f"wrote {args.doc}, {args.png}, {args.json}")


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    train_data, test = (mnist_tensors("train", limit=args.limit_train),
                         mnist_tensors("test", limit=args.limit_test))
    runs, reference = [], None
    for variant in VARIANTS:
        run, model = train(variant, train_data, test, args)
        runs.append(run)
        reference = reference or model
    distances(runs)
    assert reference is not None
    part_b = restimate(reference, train_data, test, args)
    settings = {"epochs": args.epochs, "lr": args.lr, "seed": args.seed, "threads": args.threads,
                "train_items": len(train_data[1]), "test_items": len(test[1]),
                "windows_per_epoch": len(train_data[1]) // GLOBAL_BATCH,
                "stats_windows": args.stats_windows, "trace_every": args.trace_every,
                "command": "PYTHONPATH=src python benchmarks/batchnorm_experiment.py",
                "total_seconds": time.perf_counter() - start}
    return {"machine": describe_machine(), "settings": settings, "runs": runs, "restimate": part_b}


if __name__ == "__main__":
    main()
