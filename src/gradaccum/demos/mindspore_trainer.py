"""The seed experiment on MindSpore: MNIST through :class:`gradaccum.mindspore.Accumulator`,
called inside an ``@ms.jit`` train step as in the tutorial.

Same settings, same starting weights (see :mod:`gradaccum.demos.mindspore_models`), same data
order and the same printed lines and metrics as the torch trainer, so ``gradaccum compare`` can
put the two backends side by side.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mindspore as ms
import numpy as np
import torch
from mindspore import Tensor
from mindspore import nn as msnn
from numpy.typing import NDArray
from tqdm import tqdm

from gradaccum.core import parse_schedule
from gradaccum.demos.config import ConfigError, RunResult, TrainConfig
from gradaccum.demos.distributed import Ranks, epoch_order
from gradaccum.demos.epochs import run_epochs
from gradaccum.demos.metrics import MetricsWriter, peak_rss_bytes
from gradaccum.demos.mindspore_models import build_mindspore_model
from gradaccum.demos.mnist import mnist_tensors
from gradaccum.mindspore import Accumulator

__all__ = ["evaluate", "make_optimizer", "mnist_arrays", "run_mindspore"]

Log = Callable[[str], None]


def make_optimizer(name: str, params: list[Any], lr: float) -> msnn.Optimizer:
    """``sgd`` (the seed's), ``momentum`` (0.9), ``adam`` or ``adamw`` (torch's defaults:
    weight decay 0.01, eps 1e-8).

    Raises:
        ValueError: an unknown name.
    """
    factories: dict[str, Callable[[], msnn.Optimizer]] = {
        "sgd": lambda: msnn.SGD(params, lr),
        "momentum": lambda: msnn.Momentum(params, lr, momentum=0.9),
        "adam": lambda: msnn.Adam(params, lr),
        "adamw": lambda: msnn.AdamWeightDecay(params, lr, eps=1e-8, weight_decay=0.01),
    }
    if name not in factories:
        raise ValueError(f"optimizer must be one of {sorted(factories)}, got {name!r}")
    return factories[name]()


def mnist_arrays(split: str, data_dir: Any = None,
                 limit: int | None = None) -> tuple[NDArray[np.float32], NDArray[np.int32]]:
    """One split as the seed prepares it (/255, then (x - 0.1307) / 0.3081), as NumPy arrays.

    The arrays come from :func:`gradaccum.demos.mnist.mnist_tensors`, so both backends train on
    bit-identical inputs.

    Returns:
        ``(x float32 [n, 1, 28, 28], y int32 [n])``; the first ``limit`` items when given.
    """
    x, y = mnist_tensors(split, data_dir, limit)
    return x.numpy(), y.numpy().astype(np.int32)


def evaluate(model: msnn.Cell, x: NDArray[np.float32], y: NDArray[np.int32],
             batch: int = 1000) -> tuple[float, float]:
    """Test accuracy (percent) and mean cross-entropy over every test item."""
    model.set_train(False)
    correct, loss_sum = 0, 0.0
    for i in range(0, len(x), batch):
        logits = model(Tensor(x[i:i + batch])).asnumpy().astype(np.float64)
        labels = y[i:i + batch]
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        loss_sum += float(-log_probs[np.arange(len(labels)), labels].sum())
        correct += int((logits.argmax(axis=1) == labels).sum())
    model.set_train(True)
    return 100.0 * correct / len(x), loss_sum / len(x)


@dataclass
class _Run:
    """Everything one run holds while it trains."""

    config: TrainConfig
    model: msnn.Cell
    acc: Accumulator
    step: Callable[..., Any]  # the compiled train step: (x, y[, n]) -> (loss, stepped)
    x: NDArray[np.float32]
    y: NDArray[np.int32]
    x_test: NDArray[np.float32]
    y_test: NDArray[np.int32]
    writer: MetricsWriter
    log: Log
    weighted: bool  # the data does not split into equal micro-batches: weight by items
    pending: list[tuple[Any, int]] = field(default_factory=list)  # (loss, items) of the window


def _check(config: TrainConfig) -> None:
    if config.precision != "fp32":
        raise ConfigError(f"--precision {config.precision}: the mindspore backend trains in fp32")
    if config.device != "cpu":
        raise ConfigError(f"--device {config.device}: the mindspore backend runs on the CPU here")
    if config.checkpoint_every is not None:
        raise ConfigError("--checkpoint-every: the mindspore backend does not write checkpoints")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise ConfigError("the mindspore backend runs in one process, not under torchrun")


def _setup(config: TrainConfig, log: Log) -> _Run:
    _check(config)
    ms.set_device("CPU")
    try:
        model = build_mindspore_model(config.model, config.init, seed=config.seed)
        x, y = mnist_arrays("train", config.data_dir, config.limit_train)
        x_test, y_test = mnist_arrays("test", config.data_dir, config.limit_test)
    except (OSError, ValueError) as err:
        raise ConfigError(str(err)) from err
    params = model.trainable_params()
    opt = make_optimizer(config.optimizer, params, config.lr)
    steps = parse_schedule(config.steps) if isinstance(config.steps, str) else config.steps
    weighted = len(x) % config.micro_batch != 0
    acc = Accumulator(opt, steps, weighting="items" if weighted else "mean")
    loss_fn = msnn.CrossEntropyLoss()

    def forward(xb: Tensor, yb: Tensor) -> Tensor:
        return loss_fn(model(xb), yb)

    grad_fn = ms.value_and_grad(forward, None, params)

    def train_step(xb: Tensor, yb: Tensor, n: Tensor | None = None) -> tuple[Tensor, Tensor]:
        loss, grads = grad_fn(xb, yb)
        return loss, acc(grads, n)

    return _Run(config, model, acc, ms.jit(train_step), x, y, x_test, y_test, MetricsWriter(config.out), log,
                weighted)


def _window_loss(pending: list[tuple[Any, int]], weighted: bool) -> float:
    """The window's loss, weighted like its gradient (the torch Accumulator's ``window_loss``)."""
    losses = [float(loss) for loss, _ in pending]
    if not weighted:
        return sum(losses) / len(losses)
    return sum(n * loss for (_, n), loss in zip(pending, losses, strict=True)) / sum(n for _, n in pending)


def _train_epoch(run: _Run, epoch: int) -> tuple[list[float], float]:
    """One pass over the shuffled training set. Returns (the window losses, seconds)."""
    cfg, acc = run.config, run.acc
    n, micro = len(run.x), cfg.micro_batch
    size = math.ceil(n / micro)
    # The torch trainer's order (seed and epoch only): both backends see the same windows.
    order = epoch_order(n, cfg.seed, epoch, Ranks()).numpy()
    losses: list[float] = []
    samples: list[int] = []
    bar = tqdm(total=size, desc=f"epoch {epoch}", disable=not cfg.progress, leave=False,
               unit="mb", mininterval=0.5)
    write = bar.write if cfg.progress else run.log
    start = time.perf_counter()
    for i in range(size):
        idx = order[i * micro:(i + 1) * micro]
        xb, yb = Tensor(run.x[idx]), Tensor(run.y[idx])
        if run.weighted:
            loss, stepped = run.step(xb, yb, Tensor(len(idx), ms.int32))
        else:
            loss, stepped = run.step(xb, yb)
        run.pending.append((loss, len(idx)))
        if bool(stepped):
            losses.append(_window_loss(run.pending, run.weighted))
            samples.append(min(n, (i + 1) * micro))
            run.pending.clear()
        if i % cfg.log_every == 0:
            shown = losses[-1] if losses else float(loss)
            write(f"loss: {shown:>7f}  [{i:>3d}/{size:>3d}]")
            bar.set_postfix(loss=f"{shown:.4f}", mem=f"{peak_rss_bytes() / 2**20:.0f}MB", refresh=False)
        bar.update(1)
    if cfg.end_of_epoch == "flush" and bool(acc.flush()):
        losses.append(_window_loss(run.pending, run.weighted))
        samples.append(n)
        run.pending.clear()
    seconds = time.perf_counter() - start
    bar.close()
    run.writer.windows(epoch=epoch, samples=[(epoch - 1) * n + k for k in samples], losses=losses)
    return losses, seconds


def run_mindspore(config: TrainConfig, log: Log = print) -> RunResult:
    """Run the seed experiment on MindSpore (CPU, fp32).

    Prints the seed's lines (``loss: x  [i/size]`` every ``log_every`` micro-batches, showing the
    last window's loss, and ``Test: Accuracy: x%, Avg loss: y`` per epoch), writes
    ``metrics.jsonl`` into ``config.out`` when given, and returns the per-epoch results.

    Args:
        config: the settings (``model`` ``mlp`` or ``cnn``; ``init="mindspore"`` for the
            tutorial's N(0, 0.01) weights).
        log: where the lines go.

    Returns:
        The run's results, with the final parameters as numpy arrays (torch's order and shapes).

    Raises:
        ConfigError: settings the backend does not run (bf16, a GPU device, ``cnn-bn``, checkpoints,
            torchrun), or data it cannot read.
    """
    run = _setup(config, log)
    result = run_epochs(
        config, log, run.writer, train_epoch=lambda epoch: _train_epoch(run, epoch),
        evaluate=lambda: evaluate(run.model, run.x_test, run.y_test),
        counters=lambda: (run.acc.optimizer_steps, 0), peak_memory=peak_rss_bytes,
        train_items=len(run.x))
    result.final_params = [p.asnumpy().copy() for p in run.model.trainable_params()]
    return result
