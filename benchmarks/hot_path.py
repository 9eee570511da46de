"""The Accumulator's hot path against hand-written loops: aten ops and time per micro-step.

The five loops of :mod:`gradaccum.bench.hot_path` (hand mean, gradaccum mean, hand tokens,
gradaccum int, gradaccum tensor), 4 micro-batches per window, on a trivial model (a 4-3 Linear:
the per-micro-step overhead shows), the seed MLP, or a narrow 12-layer nanoGPT with GPT-2 small's
148 parameter tensors (``gpt``: the per-parameter cost shows). Ops are counted over 3 windows
with a TorchDispatchMode (machine-independent: each op is a kernel launch on a GPU), Python calls
with ``sys.setprofile``; times are medians of windows run interleaved round by round in one
process (the order rotating), after warm-up. A second table gives the Python time of the
gradient checks (the stale-gradient check at a window's first micro-batch, the note after a
micro-batch, the check before the next and before the last) for this model's parameter tensors
and for GPT-2 small's 148.

    python benchmarks/hot_path.py [--model trivial|mlp|gpt] [--micro 8] [--rounds 300] [--threads 1]
                                  [--json docs/results/hot_path.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gradaccum.bench.hot_path import (
    STEPS,
    make_loops,
    ops_per_micro_step,
    python_calls_per_micro_step,
    window_checks,
)
from gradaccum.bench.machine import describe_machine
from gradaccum.bench.measure import interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["trivial", "mlp", "gpt"], default="trivial")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the table and the machine here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = {name: ops_per_micro_step(run) for name, run in make_loops(args.model, args.micro).items()}
    calls = {name: python_calls_per_micro_step(run)
             for name, run in make_loops(args.model, args.micro).items()}
    loops = make_loops(args.model, args.micro)
    for _ in range(args.warmup):
        for run in loops.values():
            run()
    timings = interleaved(loops, repeats=args.rounds, calls=1, warmup=False)
    setup = (f"{args.model} model, micro-batch {args.micro} x {STEPS} per window, SGD, {args.rounds} "
             f"interleaved rounds (order rotating) after {args.warmup} warm-up, {args.threads} thread(s)")
    for key, value in {**describe_machine(), "setup": setup}.items():
        print(f"{key:>14}: {value}")
    print("\n| loop | aten ops / micro-step | vs its hand loop | Python calls / micro-step "
          "| us / micro-step (median) | vs its hand loop |")
    print("|---|---|---|---|---|---|")
    rows = []
    for name in loops:
        base = "hand mean" if name in ("hand mean", "gradaccum mean") else "hand tokens"
        us = timings.median(name) * 1e6 / STEPS
        rows.append({"loop": name, "ops_per_micro_step": ops[name], "ops_vs_hand": ops[name] - ops[base],
                     "python_calls_per_micro_step": calls[name],
                     "us_per_micro_step": round(us, 1), "time_vs_hand": round(timings.ratio(name, base), 3)})
        print(f"| {name} | {ops[name]:.2f} | {ops[name] - ops[base]:+.2f} | {calls[name]:.1f} | {us:.1f} | "
              f"{timings.ratio(name, base):.3f}x |")
    print("\nIn Python (no aten op), medians of interleaved rounds: the gradient checks of "
          "torch/_window_grads.py for a model of P parameter tensors (this model; the 148 of GPT-2 "
          f"small); a window of {STEPS} takes the stale check, {STEPS - 1} notes, {STEPS - 2} checks "
          "and the last check\n")
    print("| P | stale check (us) | note (us) | check (us) | last check (us) | us per window |")
    print("|---|---|---|---|---|---|")
    n_params = len(list(make_model_params(args.model)))
    checks = []
    for tensors in (n_params, 148):
        t = window_checks(tensors)
        checks.append({"tensors": tensors, **{k: round(v, 2) for k, v in t.items()}})
        print(f"| {tensors} | {t['stale check']:.2f} | {t['note']:.2f} | {t['check']:.2f} | "
              f"{t['last check']:.2f} | {t['per window']:.2f} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"source": "python benchmarks/hot_path.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if k != "json"), "machine": describe_machine(),
            "setup": setup, "rows": rows, "window_checks_us": checks}, indent=1) + "\n")


def make_model_params(model: str) -> list[torch.nn.Parameter]:
    """The parameter tensors of the benchmark's model."""
    if model == "trivial":
        return list(torch.nn.Linear(4, 3).parameters())
    if model == "gpt":
        from gradaccum.bench.hot_path import GPT_CONFIG
        from gradaccum.demos.gpt import GPT

        return list(GPT(GPT_CONFIG).parameters())
    from gradaccum.demos.models import build_model

    return list(build_model("mlp", seed=0).parameters())


if __name__ == "__main__":
    main()
