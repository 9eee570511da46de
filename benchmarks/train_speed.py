"""Time `gradaccum train`'s default run against a hand-written PyTorch loop doing the same work.

Both train the seed experiment (MNIST, MLP, SGD lr 0.01, micro-batch 32 x 2 steps, same data
order) and evaluate after every epoch; the hand-written loop is the seed's (loss / N, backward,
step + zero_grad every N). Runs alternate A, B, A, B in one process; the table reports medians.

    python benchmarks/train_speed.py [--epochs 3] [--repeats 3] [--json docs/results/train_speed.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from gradaccum.bench.machine import describe_machine
from gradaccum.bench.results_file import write_results
from gradaccum.demos.config import TrainConfig
from gradaccum.demos.mnist import mnist_tensors
from gradaccum.demos.models import build_model
from gradaccum.demos.trainer import evaluate, run_torch


def hand_written(config: TrainConfig) -> float:
    """The seed's loop, timed like run_torch (setup included, evaluation included)."""
    start = time.perf_counter()
    model = build_model(config.model, config.init, seed=config.seed)
    x, y = mnist_tensors("train", config.data_dir, config.limit_train)
    x_test, y_test = mnist_tensors("test", config.data_dir, config.limit_test)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    steps, micro, n = int(config.steps), config.micro_batch, len(x)
    for epoch in range(1, config.epochs + 1):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(config.seed * 1000 + epoch))
        size = math.ceil(n / micro)
        for i in range(size):
            idx = order[i * micro:(i + 1) * micro]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx]) / steps
            loss.backward()
            if (i + 1) % steps == 0 or i == size - 1:
                opt.step()
                opt.zero_grad(set_to_none=True)
        evaluate(model, x_test, y_test)
    return time.perf_counter() - start


def with_gradaccum(config: TrainConfig) -> float:
    start = time.perf_counter()
    run_torch(config, log=lambda line: None)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit-train", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the table and the machine here")
    args = parser.parse_args()
    config = TrainConfig(epochs=args.epochs, progress=False, limit_train=args.limit_train)
    machine = describe_machine()
    for key, value in machine.items():
        print(f"{key}: {value}")
    hand_written(TrainConfig(epochs=1, limit_train=2048))  # warm-up: allocator, thread pools
    with_gradaccum(TrainConfig(epochs=1, limit_train=2048, progress=False))
    times: dict[str, list[float]] = {"hand-written loop": [], "gradaccum train": []}
    for _ in range(args.repeats):
        times["hand-written loop"].append(hand_written(config))
        times["gradaccum train"].append(with_gradaccum(config))
    base = statistics.median(times["hand-written loop"])
    print(f"\n{config.epochs} epoch(s) of the seed experiment, {args.repeats} runs each, interleaved\n")
    print("| run | median (s) | all runs (s) | ratio |")
    print("|---|---|---|---|")
    rows = {}
    for name, values in times.items():
        med = statistics.median(values)
        rows[name] = {"median_s": med, "runs_s": values, "ratio": med / base}
        print(f"| {name} | {med:.1f} | {', '.join(f'{v:.1f}' for v in values)} | {med / base:.3f} |")
    if args.json is not None:
        settings = {"epochs": config.epochs, "repeats": args.repeats, "micro_batch": config.micro_batch,
                    "steps": int(config.steps), "limit_train": args.limit_train}
        write_results(args.json, {"machine": machine, "settings": settings, "rows": rows}, indent=2)


if __name__ == "__main__":
    main()
