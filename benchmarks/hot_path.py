"""The Accumulator's hot path against the hand-written loop, per optimizer step.

The seed MLP (784-512-512-10) on CPU, micro-batch 8, steps 4, SGD: one window is timed for each
contender, the contenders interleaved round by round in one process (the order rotating), and
the table reports the median time per window and its ratio to the hand-written loop.

- ``hand loop``: the seed's loop, ``(loss / N).backward()``, step and ``zero_grad`` every N;
- ``gradaccum``: ``acc.backward(loss)``;
- ``hand loop, tokens``: torchtune's way, ``(loss * n).backward()``, gradients divided by the
  window's total once (one foreach pass), then step;
- ``gradaccum, n_items int`` / ``n_items tensor``: ``acc.backward(loss, n_items=n)``.

    python benchmarks/hot_path.py [--rounds 200] [--threads 1]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

import gradaccum
from gradaccum.bench.machine import describe_machine
from gradaccum.bench.measure import interleaved
from gradaccum.demos.models import build_model

MICRO, STEPS = 8, 4


def contenders(x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], None]]:
    xs, ys = x.split(MICRO), y.split(MICRO)
    runs: dict[str, Callable[[], None]] = {}

    model = build_model("mlp", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def hand() -> None:
        for xb, yb in zip(xs, ys, strict=True):
            (nn.functional.cross_entropy(model(xb), yb) / STEPS).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    runs["hand loop"] = hand

    def tokens_hand() -> Callable[[], None]:
        model = build_model("mlp", seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def run() -> None:
            total = 0
            for xb, yb in zip(xs, ys, strict=True):
                n = len(yb)
                (nn.functional.cross_entropy(model(xb), yb) * n).backward()
                total += n
            torch._foreach_mul_([p.grad for p in model.parameters()], 1.0 / total)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    runs["hand loop, tokens"] = tokens_hand()

    for name, count in (("gradaccum", None), ("gradaccum, n_items int", int),
                        ("gradaccum, n_items tensor", torch.tensor)):
        m = build_model("mlp", seed=0)
        acc = gradaccum.Accumulator(torch.optim.SGD(m.parameters(), lr=0.01), STEPS)
        # Counts made once, outside the clock, as the hand loops' Python ints are.
        counts = [None if count is None else count(len(yb)) for yb in ys]

        def run(m: nn.Module = m, acc: gradaccum.Accumulator = acc, counts=counts) -> None:  # type: ignore[no-untyped-def]
            for xb, yb, n in zip(xs, ys, counts, strict=True):
                acc.backward(nn.functional.cross_entropy(m(xb), yb), n)
        runs[name] = run
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(MICRO * STEPS, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (MICRO * STEPS,), generator=g)
    runs = contenders(x, y)
    for _ in range(args.warmup):
        for run in runs.values():
            run()
    timings = interleaved(runs, repeats=args.rounds, calls=1, warmup=False)
    for key, value in {**describe_machine(), "setup": f"MLP 784-512-512-10, micro-batch {MICRO} x steps "
                       f"{STEPS}, SGD, {args.rounds} interleaved rounds (order rotating) after "
                       f"{args.warmup} warm-up, {args.threads} thread(s)"}.items():
        print(f"{key:>14}: {value}")
    print("\n| loop | ms / window (median) | vs hand loop |\n|---|---|---|")
    for name in runs:
        print(f"| {name} | {timings.median(name) * 1e3:.3f} | {timings.ratio(name, 'hand loop'):.3f}x |")


if __name__ == "__main__":
    main()
