"""The seed experiment on MindSpore: MNIST through :class:`gradaccum.mindspore.Accumulator`,
called inside an ``@ms.jit`` train step as in the tutorial.

Same settings, same starting weights (see :mod:`gradaccum.demos.mindspore_models`), same data
order and the same printed lines and metrics as the torch trainer, so ``gradaccum compare`` can
put the two backends side by side. Under ``msrun`` (:func:`init_msrun`) every rank trains its
share of each epoch, as a DistributedSampler deals it (the torch trainer's order), and the
accumulator reduces each window over the ranks; rank 0 prints and writes.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mindspore as ms
import numpy as np
import torch
from mindspore import Tensor
from mindspore import nn as msnn
from numpy.typing import NDArray

from gradaccum.core import parse_schedule
from gradaccum.demos.config import ConfigError, RunResult, TrainConfig
from gradaccum.demos.distributed import Log, Ranks, epoch_order, rank_log
from gradaccum.demos.epochs import run_epochs
from gradaccum.demos.metrics import MetricsWriter, peak_rss_bytes
from gradaccum.demos.mindspore_models import build_mindspore_model
from gradaccum.demos.mnist import mnist_tensors
from gradaccum.mindspore import Accumulator

__all__ = ["evaluate", "init_msrun", "make_optimizer", "mindspore_ranks", "mnist_arrays", "run_mindspore"]



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


def init_msrun() -> Ranks:
    """Join the cluster ``msrun`` started this process in (CPU); one process outside msrun.

    msrun runs the same command line as its scheduler too: there ``init()`` serves the cluster
    until the workers are done, then ends the process, so nothing after this call runs on it.

    Returns:
        This process's :class:`~gradaccum.demos.distributed.Ranks`.
    """
    if "MS_ROLE" in os.environ:  # set by msrun for its scheduler and for every worker
        from mindspore.communication import init

        _use_cpu()
        init()
    return mindspore_ranks()


def _use_cpu() -> None:
    try:
        ms.set_device("CPU")
    except RuntimeError:  # MindSpore 2.10 refuses a second set_device once a device is in use
        if ms.get_context("device_target") != "CPU":
            raise


def mindspore_ranks() -> Ranks:
    """The ranks of ``mindspore.communication``'s world group (one process before ``init()``)."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank

    if not GlobalComm.INITED:
        return Ranks()
    return Ranks(get_rank(), get_group_size(), int(os.environ.get("DEVICE_ID", "0")))


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
    ranks: Ranks
    acc: Accumulator
    step: Callable[..., Any]  # the compiled train step: (x, y[, n]) -> (loss, stepped)
    x: NDArray[np.float32]
    y: NDArray[np.int32]
    x_test: NDArray[np.float32]
    y_test: NDArray[np.int32]
    writer: MetricsWriter
    log: Log
    weighted: bool  # this rank's share does not split into equal micro-batches: weight by items


def _check(config: TrainConfig) -> None:
    if config.precision != "fp32":
        raise ConfigError(f"--precision {config.precision}: the mindspore backend trains in fp32")
    if config.device != "cpu":
        raise ConfigError(f"--device {config.device}: the mindspore backend runs on the CPU here")
    if config.checkpoint_every is not None:
        raise ConfigError("--checkpoint-every: the mindspore backend does not write checkpoints")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise ConfigError("the mindspore backend runs in one process or under msrun, not under torchrun")


def _setup(config: TrainConfig, log: Log) -> _Run:
    _check(config)
    _use_cpu()
    ranks = mindspore_ranks()
    try:
        model = build_mindspore_model(config.model, config.init, seed=config.seed, bn=config.bn,
                                      steps=config.steps if isinstance(config.steps, int) else None)
        x, y = mnist_arrays("train", config.data_dir, config.limit_train)
        x_test, y_test = mnist_arrays("test", config.data_dir, config.limit_test)
    except (OSError, ValueError) as err:
        raise ConfigError(str(err)) from err
    model.set_train(True)  # BatchNorm: batch statistics while training
    params = model.trainable_params()
    opt = make_optimizer(config.optimizer, params, config.lr)
    steps = parse_schedule(config.steps) if isinstance(config.steps, str) else config.steps
    weighted = -(-len(x) // ranks.world) % config.micro_batch != 0  # a rank's (padded) share
    acc = Accumulator(opt, steps, weighting="items" if weighted else "mean")
    loss_fn = msnn.CrossEntropyLoss()

    def forward(xb: Tensor, yb: Tensor) -> Tensor:
        return loss_fn(model(xb), yb)

    grad_fn = ms.value_and_grad(forward, None, params)

    def train_step(xb: Tensor, yb: Tensor, n: Tensor | None = None) -> tuple[Tensor, Tensor]:
        loss, grads = grad_fn(xb, yb)
        return loss, acc(grads, n, loss=loss)

    return _Run(config, model, ranks, acc, ms.jit(train_step), x, y, x_test, y_test,
                MetricsWriter(config.out if ranks.main else None), log, weighted)


def _window_loss(acc: Accumulator) -> float:
    loss = acc.window_loss
    assert loss is not None, "the train step passes loss= on every call"
    return loss


def _train_epoch(run: _Run, epoch: int) -> tuple[list[float], float]:
    """One pass over the shuffled training set. Returns (the window losses, seconds)."""
    cfg, acc, world = run.config, run.acc, run.ranks.world
    # The torch trainer's order (seed and epoch only): both backends see the same windows, and
    # W ranks x micro-batch m see those of one process with micro-batch W x m.
    order = epoch_order(len(run.x), cfg.seed, epoch, run.ranks).numpy()
    n, micro = len(order), cfg.micro_batch
    size = math.ceil(n / micro)
    losses: list[float] = []
    samples: list[int] = []
    from tqdm import tqdm  # the demo extra: imported only when a run shows progress

    bar = tqdm(total=size, desc=f"epoch {epoch}", disable=not (cfg.progress and run.ranks.main),
               leave=False, unit="mb", mininterval=0.5)
    write = bar.write if cfg.progress else run.log
    start = time.perf_counter()
    for i in range(size):
        idx = order[i * micro:(i + 1) * micro]
        xb, yb = Tensor(run.x[idx]), Tensor(run.y[idx])
        if run.weighted:
            loss, stepped = run.step(xb, yb, Tensor(len(idx), ms.int32))
        else:
            loss, stepped = run.step(xb, yb)
        if bool(stepped):
            losses.append(_window_loss(acc))
            samples.append(min(n, (i + 1) * micro) * world)
        if i % cfg.log_every == 0:
            shown = losses[-1] if losses else float(loss)
            write(f"loss: {shown:>7f}  [{i:>3d}/{size:>3d}]")
            bar.set_postfix(loss=f"{shown:.4f}", mem=f"{peak_rss_bytes() / 2**20:.0f}MB", refresh=False)
        bar.update(1)
    if cfg.end_of_epoch == "flush" and bool(acc.flush()):  # every rank calls it
        losses.append(_window_loss(acc))
        samples.append(n * world)
    seconds = time.perf_counter() - start
    bar.close()
    run.writer.windows(epoch=epoch, samples=[(epoch - 1) * n * world + k for k in samples],
                       losses=losses)
    return losses, seconds


def run_mindspore(config: TrainConfig, log: Log = print) -> RunResult:
    """Run the seed experiment on MindSpore (CPU, fp32).

    Prints the seed's lines (``loss: x  [i/size]`` every ``log_every`` micro-batches, showing the
    last window's loss, and ``Test: Accuracy: x%, Avg loss: y`` per epoch), writes
    ``metrics.jsonl`` into ``config.out`` when given, and returns the per-epoch results. After
    :func:`init_msrun` every rank trains its share; rank 0 prints and writes.

    Args:
        config: the settings (``model`` ``mlp``, ``cnn`` or ``cnn-bn``; ``init="mindspore"`` for
            the tutorial's N(0, 0.01) weights).
        log: where the lines go.

    Returns:
        The run's results, with the final parameters as numpy arrays (torch's order and shapes).

    Raises:
        ConfigError: settings the backend does not run (bf16, a GPU device, ``--bn window``,
            checkpoints, torchrun), or data it cannot read.
    """
    run = _setup(config, log)
    log = rank_log(log, run.ranks)  # window losses and parameters agree on every rank
    result = run_epochs(
        config, log, run.writer, train_epoch=lambda epoch: _train_epoch(run, epoch),
        evaluate=lambda: evaluate(run.model, run.x_test, run.y_test),
        counters=lambda: (run.acc.optimizer_steps, 0), peak_memory=peak_rss_bytes,
        train_items=len(run.x))
    result.final_params = [p.asnumpy().copy() for p in run.model.trainable_params()]
    return result
