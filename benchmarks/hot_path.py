"""The Accumulator's hot path against hand-written loops: aten ops and time per micro-step.

The five loops of :mod:`gradaccum.bench.hot_path` (hand mean, gradaccum mean, hand tokens,
gradaccum int, gradaccum tensor), 4 micro-batches per window, on a trivial model (a 4-3 Linear:
the per-micro-step overhead shows) or the seed MLP. Ops are counted over 3 windows with a
TorchDispatchMode (machine-independent: each op is a kernel launch on a GPU); times are medians
of windows run interleaved round by round in one process (the order rotating), after warm-up.
A second table gives the Python time of the once-per-window gradient checks (stale gradients,
the record after a window's first micro-batch, the check before its last) for this model's
parameter tensors and for GPT-2 small's 148.

    python benchmarks/hot_path.py [--model trivial|mlp] [--micro 8] [--rounds 300] [--threads 1]
                                  [--json docs/results/hot_path.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gradaccum.bench.hot_path import STEPS, make_loops, ops_per_micro_step, window_checks
from gradaccum.bench.machine import describe_machine
from gradaccum.bench.measure import interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["trivial", "mlp"], default="trivial")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the table and the machine here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = {name: ops_per_micro_step(run) for name, run in make_loops(args.model, args.micro).items()}
    loops = make_loops(args.model, args.micro)
    for _ in range(args.warmup):
        for run in loops.values():
            run()
    timings = interleaved(loops, repeats=args.rounds, calls=1, warmup=False)
    setup = (f"{args.model} model, micro-batch {args.micro} x {STEPS} per window, SGD, {args.rounds} "
             f"interleaved rounds (order rotating) after {args.warmup} warm-up, {args.threads} thread(s)")
    for key, value in {**describe_machine(), "setup": setup}.items():
        print(f"{key:>14}: {value}")
    print("\n| loop | aten ops / micro-step | vs its hand loop | us / micro-step (median) "
          "| vs its hand loop |")
    print("|---|---|---|---|---|")
    rows = []
    for name in loops:
        base = "hand mean" if name in ("hand mean", "gradaccum mean") else "hand tokens"
        us = timings.median(name) * 1e6 / STEPS
        rows.append({"loop": name, "ops_per_micro_step": ops[name], "ops_vs_hand": ops[name] - ops[base],
                     "us_per_micro_step": round(us, 1), "time_vs_hand": round(timings.ratio(name, base), 3)})
        print(f"| {name} | {ops[name]:.2f} | {ops[name] - ops[base]:+.2f} | {us:.1f} | "
              f"{timings.ratio(name, base):.3f}x |")
    print("\nOnce per window, in Python (no aten op), medians of interleaved rounds: the gradient "
          "checks of torch/_window_grads.py for a model of P parameter tensors (this model; the "
          "148 of GPT-2 small)\n")
    print("| P | stale check (us) | record (us) | check (us) | us per window |")
    print("|---|---|---|---|---|")
    n_params = len(list(make_model_params(args.model)))
    checks = []
    for tensors in (n_params, 148):
        t = window_checks(tensors)
        total = sum(t.values())
        checks.append({"tensors": tensors, **{k: round(v, 2) for k, v in t.items()},
                       "total": round(total, 2)})
        print(f"| {tensors} | {t['stale check']:.2f} | {t['record']:.2f} | {t['check']:.2f} | {total:.2f} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"source": "python benchmarks/hot_path.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if k != "json"), "machine": describe_machine(),
            "setup": setup, "rows": rows, "window_checks_us": checks}, indent=1) + "\n")


def make_model_params(model: str) -> list[torch.nn.Parameter]:
    """The parameter tensors of the benchmark's model."""
    if model == "trivial":
        return list(torch.nn.Linear(4, 3).parameters())
    from gradaccum.demos.models import build_model

    return list(build_model("mlp", seed=0).parameters())


if __name__ == "__main__":
    main()
