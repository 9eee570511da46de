"""What ``gradaccum bench`` measures: the sizes of a full run and of a smoke run, and the data."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from gradaccum.demos.models import MODELS

__all__ = ["FULL", "SMOKE", "Sizes", "micro_batches", "mnist_train"]


@dataclass(frozen=True)
class Sizes:
    """The sizes of one benchmark run.

    Attributes:
        overhead: ``(model, micro-batch)`` tasks timed against the hand-written loop and Accelerate.
        steps: micro-batches per window in the overhead tasks (N).
        repeats: timed samples per contender, after a warm-up round (medians over these).
        sample_seconds: the length of one timed sample; it holds as many windows as fit (>= 1).
        sweep_model: the model of the memory sweep.
        global_batch: the window of the memory sweep (items per optimizer step).
        sweep: the micro-batches of the memory sweep, largest first.
        sweep_repeats: timed windows per micro-batch and malloc setting in the memory sweep
            (after one warm-up window: the memory measurement's, in this process).
        seed_models: the models of the seed-accumulator comparison.
        seed_micro_batch: its micro-batch.
    """

    overhead: tuple[tuple[str, int], ...]
    steps: int
    repeats: int
    sample_seconds: float
    sweep_model: str
    global_batch: int
    sweep: tuple[int, ...]
    sweep_repeats: int
    seed_models: tuple[str, ...]
    seed_micro_batch: int


FULL = Sizes(
    overhead=(("mlp", 8), ("mlp", 32), ("bench-cnn", 16)),
    steps=4, repeats=7, sample_seconds=1.0,
    sweep_model="bench-cnn", global_batch=256, sweep=(256, 128, 64, 32, 16, 8), sweep_repeats=2,
    seed_models=("mlp", "bench-cnn"), seed_micro_batch=16,
)

# Seconds, for CI: every code path runs, on tiny batches and the small MNIST CNN.
SMOKE = Sizes(
    overhead=(("mlp", 8), ("cnn", 4)),
    steps=2, repeats=3, sample_seconds=0.0,
    sweep_model="cnn", global_batch=8, sweep=(8, 4, 2), sweep_repeats=1,
    seed_models=("mlp", "cnn"), seed_micro_batch=2,
)


@functools.lru_cache(maxsize=4)
def mnist_train(n: int, data_dir: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` MNIST training images and labels (read once per size and folder;
    ``data_dir``: as :func:`gradaccum.demos.mnist.load_mnist`'s)."""
    from gradaccum.demos.mnist import mnist_tensors

    return mnist_tensors("train", data_dir, limit=n)


def micro_batches(model: str, micro_batch: int, count: int, device: torch.device,
                  seed: int = 0, data_dir: Path | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` micro-batches of inputs and labels for a demo model.

    The MLP gets MNIST images (from ``data_dir``, else the checkout's copy or the user's cache),
    the others random inputs of their shape and random labels out of 10 classes: the cost of a
    step does not depend on the values.

    Example:
        >>> [tuple(x.shape) for x, _ in micro_batches("mlp", 8, 2, torch.device("cpu"))]
        [(8, 1, 28, 28), (8, 1, 28, 28)]
    """
    n = micro_batch * count
    if model == "mlp":
        x, y = mnist_train(n, data_dir)
    else:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, *MODELS[model][1], generator=g)
        y = torch.randint(0, 10, (n,), generator=g)
    return list(zip(torch.split(x.to(device), micro_batch), torch.split(y.to(device), micro_batch),
               strict=True))
