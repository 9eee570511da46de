"""The gradient guards' cost on a 148-tensor model, against the hand loop, for any gradaccum.

Runs in one process: the hand loop (``(loss / N).backward()``, step and ``zero_grad`` every N) and
``acc.backward(loss)`` on the same narrow 12-layer nanoGPT (GPT-2 small's 148 parameter tensors,
``gradaccum.bench.hot_path.GPT_CONFIG``'s sizes, written out here so that older versions of
gradaccum run it too), windows interleaved round by round after warm-up; prints the median time
per window of each, their ratio with the spread over the rounds' halves, Python calls per
micro-step (``sys.setprofile`` call events: in all, and those made while autograd's engine runs a
backward, which a hook on a parameter makes), aten ops per micro-step, and how many parameters
hold torch's post-accumulate-grad wrapper after the run (it enters Python on every backward
without a call event once its hooks are removed). Point ``PYTHONPATH`` at another checkout's
``src`` to measure that version:

    python benchmarks/guard_cost.py [--rounds 300] [--json docs/results/guard_cost.json]
    PYTHONPATH=/path/to/0.3.0/src python benchmarks/guard_cost.py --label 0.3.0 --json OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradaccum
from gradaccum.bench.hot_path import OpCounter  # in 0.3.0 too
from gradaccum.demos.gpt import GPT, GPTConfig

STEPS, MICRO = 4, 8
CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=12, n_head=2, n_embd=32)


def loops() -> tuple[dict[str, Any], list[nn.Module]]:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (MICRO, CONFIG.block_size), generator=g),
                torch.randint(0, 256, (MICRO, CONFIG.block_size), generator=g)) for _ in range(STEPS)]
    models = []

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = m(x, y)[1]
        return out

    torch.manual_seed(0)
    hand_model = GPT(CONFIG)
    hand_opt = torch.optim.SGD(hand_model.parameters(), lr=0.01)

    def hand() -> None:
        for x, y in batches:
            (loss(hand_model, x, y) / STEPS).backward()  # type: ignore[no-untyped-call]
        hand_opt.step()
        hand_opt.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    acc_model = GPT(CONFIG)
    acc = gradaccum.Accumulator(torch.optim.SGD(acc_model.parameters(), lr=0.01), STEPS)

    def accumulated() -> None:
        for x, y in batches:
            acc.backward(loss(acc_model, x, y))

    models += [hand_model, acc_model]
    return {"hand": hand, "gradaccum": accumulated}, models


def per_micro_step(run: Any, counter: str) -> float:
    run()
    if counter == "ops":
        with OpCounter() as c:
            run()
            run()
        return c.count / (2 * STEPS)
    count, inside = [0], [0]  # calls; calls while autograd's engine runs a backward

    def profile(frame: Any, event: str, arg: Any) -> None:
        engine = event in ("c_call", "c_return") and getattr(arg, "__name__", "") == "run_backward"
        if engine:
            inside.append(event == "c_call")
        elif event in ("call", "c_call"):
            count[0] += 1
            if len(inside) > 1 and inside[-1]:
                inside[0] += 1
    sys.setprofile(profile)
    try:
        run()
        run()
    finally:
        sys.setprofile(None)
    return (inside[0] if counter == "inside" else count[0]) / (2 * STEPS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs, models = loops()
    calls = {k: per_micro_step(r, "calls") for k, r in runs.items()}
    inside = {k: per_micro_step(r, "inside") for k, r in runs.items()}
    ops = {k: per_micro_step(r, "ops") for k, r in runs.items()}
    for _ in range(args.warmup):
        for r in runs.values():
            r()
    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for i in range(args.rounds):
        for k in names[i % 2:] + names[:i % 2]:  # the order alternating
            t = time.perf_counter()
            runs[k]()
            times[k].append(time.perf_counter() - t)
    ratios = [a / b for a, b in zip(times["gradaccum"], times["hand"], strict=True)]
    half = args.rounds // 2
    med = {k: statistics.median(v) for k, v in times.items()}
    wrapped = sum(p._post_accumulate_grad_hooks is not None for p in models[1].parameters())
    row = {"label": args.label, "gradaccum": getattr(gradaccum, "__version__", "?"),
           "torch": torch.__version__, "threads": args.threads, "rounds": args.rounds,
           "tensors": len(list(models[1].parameters())),
           "ms_per_window_hand": round(med["hand"] * 1e3, 3),
           "ms_per_window_gradaccum": round(med["gradaccum"] * 1e3, 3),
           "ratio_of_medians": round(med["gradaccum"] / med["hand"], 4),
           "median_ratio_first_half": round(statistics.median(ratios[:half]), 4),
           "median_ratio_second_half": round(statistics.median(ratios[half:]), 4),
           "python_calls_per_micro_step": {k: round(v, 2) for k, v in calls.items()},
           "python_calls_inside_backward": {k: round(v, 2) for k, v in inside.items()},
           "aten_ops_per_micro_step": {k: round(v, 2) for k, v in ops.items()},
           "parameters_with_a_post_accumulate_wrapper": wrapped}
    print(json.dumps(row, indent=1))
    if args.json is not None:
        rows = json.loads(args.json.read_text())["rows"] if args.json.exists() else []
        rows = [r for r in rows if r["label"] != args.label] + [row]
        args.json.write_text(json.dumps({"source": "python benchmarks/guard_cost.py", "rows": rows},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
