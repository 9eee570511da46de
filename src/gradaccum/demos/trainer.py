"""The seed experiment on PyTorch: MNIST through a :class:`gradaccum.Accumulator`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from gradaccum.core import parse_schedule
from gradaccum.demos.config import RunResult, TrainConfig
from gradaccum.demos.distributed import Ranks, current_ranks, epoch_order, wrap
from gradaccum.demos.epochs import run_epochs
from gradaccum.demos.metrics import MetricsWriter, peak_rss_bytes
from gradaccum.demos.mnist import mnist_tensors
from gradaccum.demos.models import apply_bn_mode, build_model
from gradaccum.torch import Accumulator
from gradaccum.torch.batchnorm.convert import to_groupnorm
from gradaccum.torch.batchnorm.window import to_window_batchnorm

__all__ = ["evaluate", "make_optimizer", "run_torch"]

Log = Callable[[str], None]


def make_optimizer(name: str, params: object, lr: float) -> torch.optim.Optimizer:
    """``sgd`` (the seed's), ``momentum`` (SGD, 0.9), ``adam`` or ``adamw``.

    Raises:
        ValueError: an unknown name.
    """
    factories: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "sgd": lambda: torch.optim.SGD(params, lr=lr),  # type: ignore[arg-type]
        "momentum": lambda: torch.optim.SGD(params, lr=lr, momentum=0.9),  # type: ignore[arg-type]
        "adam": lambda: torch.optim.Adam(params, lr=lr),  # type: ignore[arg-type]
        "adamw": lambda: torch.optim.AdamW(params, lr=lr),  # type: ignore[arg-type]
    }
    if name not in factories:
        raise ValueError(f"optimizer must be one of {sorted(factories)}, got {name!r}")
    return factories[name]()


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> tuple[float, float]:
    """Test accuracy (percent) and mean cross-entropy over every test item."""
    model.eval()
    correct, loss_sum = 0, 0.0
    for xb, yb in zip(torch.split(x, batch), torch.split(y, batch), strict=True):
        out = model(xb)
        loss_sum += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    model.train()
    return 100.0 * correct / len(x), loss_sum / len(x)


@dataclass
class _Run:
    """Everything one run holds while it trains."""

    config: TrainConfig
    model: nn.Module
    net: nn.Module  # what the forward runs through: the model, or its DDP wrapper on several ranks
    ranks: Ranks
    acc: Accumulator
    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    device: torch.device
    writer: MetricsWriter
    log: Log
    weighted: bool  # the data does not split into equal micro-batches: weight by items
    autocast: Callable[[], AbstractContextManager[object]]  # the forward's precision


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def _setup(config: TrainConfig, log: Log) -> _Run:
    device = torch.device(config.device)
    ranks = current_ranks()
    model = build_model(config.model, config.init, seed=config.seed).to(device)
    if ranks.world > 1:
        # Convert before DDP wraps the model, so that DDP holds (and broadcasts) the final
        # modules; window statistics are pooled over the ranks, as one large batch's would be.
        # apply_bn_mode below then only attaches them to the accumulator.
        if config.bn == "window":
            model = to_window_batchnorm(model, sync=True)
        elif config.bn == "groupnorm":
            model = to_groupnorm(model)
    net = wrap(model, ranks, device)
    x, y = mnist_tensors("train", config.data_dir, config.limit_train)
    x_test, y_test = mnist_tensors("test", config.data_dir, config.limit_test)
    opt = make_optimizer(config.optimizer, model.parameters(), config.lr)
    bf16 = config.precision == "bf16"
    steps = parse_schedule(config.steps) if isinstance(config.steps, str) else config.steps
    # bf16 autocast needs no GradScaler (float32's exponent range), but a diverging window can
    # still overflow: skip it whole and count it (EpochResult.skipped_windows).
    acc = Accumulator(opt, steps, model=net, skip_nonfinite=bf16)
    model = apply_bn_mode(model, config.bn, acc)
    if ranks.world == 1:
        net = model  # a BN mode may return a converted model
    per_rank = -(-len(x) // ranks.world)  # a DistributedSampler's share (padded)
    return _Run(config, model, net, ranks, acc, x.to(device), y.to(device), x_test.to(device),
                y_test.to(device), device, MetricsWriter(config.out if ranks.main else None), log,
                weighted=per_rank % config.micro_batch != 0,
                autocast=(lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16
                else nullcontext)


def _train_epoch(run: _Run, epoch: int) -> tuple[list[float], float]:
    """One pass over the shuffled training set. Returns (the window losses, seconds)."""
    cfg, acc, model, world = run.config, run.acc, run.net, run.ranks.world
    # The order depends on the seed and epoch only, so every micro x steps setting sees the same
    # items in the same order: a window of 32x2 holds exactly the items of one batch of 64 (and
    # so does one of 16x2 on each of 2 ranks: see gradaccum.demos.distributed).
    order = epoch_order(len(run.x), cfg.seed, epoch, run.ranks).to(run.device)
    n, micro = len(order), cfg.micro_batch
    size = math.ceil(n / micro)
    # Window losses stay on the device until the epoch ends: no host sync per window.
    losses: list[torch.Tensor] = []
    samples: list[int] = []
    from tqdm import tqdm  # the demo extra: imported only when a run shows progress

    bar = tqdm(total=size, desc=f"epoch {epoch}", disable=not (cfg.progress and run.ranks.main), leave=False,
               unit="mb", mininterval=0.5)
    write = bar.write if cfg.progress else run.log
    start = time.perf_counter()
    for i in range(size):
        idx = order[i * micro:(i + 1) * micro]
        with run.autocast():
            loss = nn.functional.cross_entropy(model(run.x[idx]), run.y[idx])
        acc.backward(loss, n_items=len(idx) if run.weighted else None)
        if acc.micro_step == 0 and acc.window_loss is not None:  # a window was applied
            losses.append(acc.window_loss)
            samples.append(min(n, (i + 1) * micro) * world)
        if i % cfg.log_every == 0:
            shown = float(losses[-1] if losses else loss.detach())
            write(f"loss: {shown:>7f}  [{i:>3d}/{size:>3d}]")
            bar.set_postfix(loss=f"{shown:.4f}", mem=f"{_peak_memory(run.device) / 2**20:.0f}MB",
                            refresh=False)
        bar.update(1)
    if cfg.end_of_epoch == "flush" and acc.flush() and acc.window_loss is not None:
        losses.append(acc.window_loss)
        samples.append(n * world)
    seconds = time.perf_counter() - start
    bar.close()
    values = torch.stack(losses).tolist() if losses else []
    run.writer.windows(epoch=epoch, samples=[(epoch - 1) * n * world + k for k in samples],
                       losses=values)
    return values, seconds


def _quiet(line: str) -> None:
    """Drop a line (ranks other than 0)."""


def run_torch(config: TrainConfig, log: Log = print) -> RunResult:
    """Run the seed experiment on PyTorch.

    Prints the seed's lines (``loss: x  [i/size]`` every ``log_every`` micro-batches, showing the
    last window's loss, and ``Test: Accuracy: x%, Avg loss: y`` per epoch), writes
    ``metrics.jsonl`` into ``config.out`` when given, and returns the per-epoch results. Inside
    an initialized process group (``gradaccum train`` under torchrun) every rank trains its
    DistributedSampler share through DDP; rank 0 prints and writes.

    Args:
        config: the settings.
        log: where the lines go.

    Returns:
        The run's results, with the final parameters as numpy arrays.
    """
    if not current_ranks().main:
        log = _quiet  # rank 0 prints for all (window losses and the model agree on every rank)
    run = _setup(config, log)
    result = run_epochs(
        config, log, run.writer, train_epoch=lambda epoch: _train_epoch(run, epoch),
        evaluate=lambda: evaluate(run.model, run.x_test, run.y_test),
        counters=lambda: (run.acc.optimizer_steps, run.acc.skipped_windows),
        peak_memory=lambda: _peak_memory(run.device), train_items=len(run.x))
    result.final_params = [p.detach().cpu().numpy() for p in run.model.parameters()]
    return result
