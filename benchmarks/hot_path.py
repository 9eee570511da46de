"""The Accumulator's hot path against the hand-written loop, per optimizer step.

The seed MLP (784-512-512-10) on CPU, micro-batch 8, steps 4, SGD: one window is timed for each
contender, the contenders interleaved round by round in one process (A, B, C, ... then again), and
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
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import gradaccum
from gradaccum.bench.machine import describe_machine

MICRO, STEPS = 8, 4


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def contenders(x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[], None]]:
    xs, ys = x.split(MICRO), y.split(MICRO)
    runs: dict[str, Callable[[], None]] = {}

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def hand() -> None:
        for xb, yb in zip(xs, ys, strict=True):
            (nn.functional.cross_entropy(model(xb), yb) / STEPS).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    runs["hand loop"] = hand

    def tokens_hand() -> Callable[[], None]:
        model = mlp()
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
        m = mlp()
        acc = gradaccum.Accumulator(torch.optim.SGD(m.parameters(), lr=0.01), STEPS)

        def run(m: nn.Module = m, acc: gradaccum.Accumulator = acc, count=count) -> None:  # type: ignore[no-untyped-def]
            for xb, yb in zip(xs, ys, strict=True):
                loss = nn.functional.cross_entropy(m(xb), yb)
                acc.backward(loss, None if count is None else count(len(yb)))
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
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.warmup + args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if r >= args.warmup:
                times[name].append(time.perf_counter() - start)
    for key, value in {**describe_machine(), "setup": f"MLP 784-512-512-10, micro-batch {MICRO} x steps "
                       f"{STEPS}, SGD, {args.rounds} interleaved rounds after {args.warmup} warm-up, "
                       f"{args.threads} thread(s)"}.items():
        print(f"{key:>14}: {value}")
    base = statistics.median(times["hand loop"])
    print("\n| loop | ms / window (median) | vs hand loop |\n|---|---|---|")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"| {name} | {med * 1e3:.3f} | {med / base:.3f}x |")


if __name__ == "__main__":
    main()
