"""The seed experiment on PyTorch: MNIST through a :class:`gradaccum.Accumulator`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradaccum.core import parse_schedule
from gradaccum.demos.config import ConfigError, EpochResult, RunResult, TrainConfig
from gradaccum.demos.distributed import Log, Ranks, current_ranks, epoch_order, rank_log, wrap
from gradaccum.demos.epochs import run_epochs
from gradaccum.demos.metrics import MetricsWriter, peak_rss_bytes
from gradaccum.demos.mnist import mnist_tensors
from gradaccum.demos.models import apply_bn_mode, build_model
from gradaccum.run_folder.checkpoint import Position, restore_rng, save_checkpoint
from gradaccum.run_folder.checkpoint_fields import check_position
from gradaccum.run_folder.interrupt import Interrupted, StopFlag
from gradaccum.run_folder.outputs import CHECKPOINT
from gradaccum.torch import Accumulator
from gradaccum.torch.batchnorm.convert import to_groupnorm
from gradaccum.torch.batchnorm.window import to_window_batchnorm

__all__ = ["evaluate", "make_optimizer", "run_torch"]



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
    result: RunResult  # the finished epochs (a resumed run's included)
    position: Position  # where the first epoch of this session starts
    stop: StopFlag | None  # a signal asks the loop to checkpoint and stop
    started: float = 0.0  # time.perf_counter() at the start of this session
    saved_windows: int = 0  # acc.windows at the last checkpoint

    @property
    def anywhere(self) -> bool:
        """May a checkpoint fall inside a window? Not where each rank holds its own partial
        gradients, nor under window BatchNorm, whose pending statistics no state_dict holds."""
        return self.ranks.world == 1 and self.config.bn != "window"


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def _load_data(config: TrainConfig) -> tuple[torch.Tensor, ...]:
    try:
        x, y = mnist_tensors("train", config.data_dir, config.limit_train)
        x_test, y_test = mnist_tensors("test", config.data_dir, config.limit_test)
    except (OSError, ValueError) as err:
        raise ConfigError(str(err)) from err
    return x, y, x_test, y_test


def _restore(run: _Run, state: dict[str, Any]) -> None:
    """Load a checkpoint into a freshly built run (its settings already checked)."""
    per_rank = -(-len(run.x) // run.ranks.world)
    check_position(state["position"], run.config, CHECKPOINT,
                   micro_batches=math.ceil(per_rank / run.config.micro_batch), results=EpochResult)
    try:
        run.model.load_state_dict(state["model"])
        run.acc.optimizer.load_state_dict(state["optimizer"])
        run.acc.load_state_dict(state["accumulator"])
    except (KeyError, RuntimeError, TypeError, ValueError) as err:
        raise ConfigError(f"--resume: the checkpoint does not fit this run: "
                          f"{str(err).splitlines()[0]}") from err
    restore_rng(state["rng"])  # last: building the model drew from the generator
    run.position = Position(**state["position"])
    run.result.epochs = [EpochResult(**e) for e in run.position.epochs]
    run.result.seconds = run.position.run_seconds
    run.saved_windows = run.acc.windows


def _setup(config: TrainConfig, log: Log, resume: dict[str, Any] | None, stop: StopFlag | None) -> _Run:
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
    x, y, x_test, y_test = _load_data(config)
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
    run = _Run(config, model, net, ranks, acc, x.to(device), y.to(device), x_test.to(device),
               y_test.to(device), device, MetricsWriter(None), log,
               weighted=per_rank % config.micro_batch != 0,
               autocast=(lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16
               else nullcontext, result=RunResult(config), position=Position(), stop=stop)
    if resume is not None:
        _restore(run, resume)
        log(f"Resumed from {config.out}: epoch {run.position.epoch}, micro-batch "
            f"{run.position.micro_batch}, {acc.optimizer_steps} optimizer steps done")
    # After a restore that fits: a checkpoint that does not leaves metrics.jsonl as it was.
    run.writer = MetricsWriter(config.out if ranks.main else None, run.position.records)
    run.started = time.perf_counter()
    return run


def _stop_signal(run: _Run) -> int:
    """The signal that asks the run to stop here, or 0; several ranks agree on it at each
    window's start (one small all-reduce per window), to stop at the same one."""
    if run.stop is None or not (run.anywhere or run.acc.micro_step == 0):
        return 0
    if run.ranks.world == 1:
        return run.stop.signum
    flag = torch.tensor([run.stop.signum], device=run.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _checkpoint(run: _Run, position: Position) -> Path | None:
    """Write the checkpoint (rank 0; the others wait until it is on disk); its path."""
    if run.config.out is None:
        return None
    position.epochs = [asdict(e) for e in run.result.epochs]
    position.records = list(run.writer.records)
    position.run_seconds = run.result.seconds + time.perf_counter() - run.started
    if run.ranks.main:
        save_checkpoint(run.config.out, config=run.config, world=run.ranks.world, model=run.model,
                        optimizer=run.acc.optimizer, accumulator=run.acc, position=position)
    if run.ranks.world > 1:
        dist.barrier()  # no rank stops, or runs on into the next checkpoint, before it is written
    run.saved_windows = run.acc.windows
    return run.config.out / CHECKPOINT


def _train_epoch(run: _Run, epoch: int) -> tuple[list[float], float]:
    """One pass over the shuffled training set (from the resume point in the run's first epoch).
    Returns (the window losses, seconds)."""
    cfg, acc, model, world = run.config, run.acc, run.net, run.ranks.world
    # The order depends on the seed and epoch only, so every micro x steps setting sees the same
    # items in the same order: a window of 32x2 holds exactly the items of one batch of 64 (and
    # so does one of 16x2 on each of 2 ranks: see gradaccum.demos.distributed). A resumed run
    # draws the same order and skips what it already trained on.
    order = epoch_order(len(run.x), cfg.seed, epoch, run.ranks).to(run.device)
    n, micro = len(order), cfg.micro_batch
    size = math.ceil(n / micro)
    resumed = run.position if run.position.epoch == epoch else Position(epoch)
    done_losses, samples = list(resumed.window_losses), list(resumed.window_samples)
    # Window losses stay on the device until the epoch ends (no host sync per window), in one
    # buffer written in place. Not a new small tensor kept per window: one would often land in
    # the hole the window's freed gradients left in glibc's heap, so that the next gradients no
    # longer fit there and grow the heap, window after window (1.2 GB in an epoch of 32 x 2).
    losses = torch.empty(size + 1, dtype=torch.float64, device=run.device)
    count = 0
    from tqdm import tqdm  # the demo extra: imported only when a run shows progress

    bar = tqdm(total=size, initial=resumed.micro_batch, desc=f"epoch {epoch}", leave=False,
               disable=not (cfg.progress and run.ranks.main), unit="mb", mininterval=0.5)
    write = bar.write if cfg.progress else run.log
    start = time.perf_counter()

    def here(i: int) -> Position:
        return Position(epoch, i, done_losses + losses[:count].tolist(), list(samples),
                        resumed.epoch_seconds + time.perf_counter() - start)

    for i in range(resumed.micro_batch, size):
        if signum := _stop_signal(run):
            bar.close()
            where = f"at epoch {epoch}, micro-batch {i} of {size}"
            raise Interrupted(signum, _checkpoint(run, here(i)), where=where)
        idx = order[i * micro:(i + 1) * micro]
        with run.autocast():
            loss = nn.functional.cross_entropy(model(run.x[idx]), run.y[idx])
        acc.backward(loss, n_items=len(idx) if run.weighted else None)
        if acc.micro_step == 0 and acc.window_loss is not None:  # a window was applied
            losses[count] = acc.window_loss
            count += 1
            samples.append(min(n, (i + 1) * micro) * world)
            if cfg.checkpoint_every and acc.windows - run.saved_windows >= cfg.checkpoint_every:
                _checkpoint(run, here(i + 1))
        if i % cfg.log_every == 0:
            shown = (float(losses[count - 1]) if count else done_losses[-1] if done_losses
                     else float(loss.detach()))
            write(f"loss: {shown:>7f}  [{i:>3d}/{size:>3d}]")
            bar.set_postfix(loss=f"{shown:.4f}", mem=f"{_peak_memory(run.device) / 2**20:.0f}MB",
                            refresh=False)
        bar.update(1)
    if cfg.end_of_epoch == "flush" and acc.flush() and acc.window_loss is not None:
        losses[count] = acc.window_loss
        count += 1
        samples.append(n * world)
    seconds = resumed.epoch_seconds + time.perf_counter() - start
    bar.close()
    values = done_losses + losses[:count].tolist()
    run.writer.windows(epoch=epoch, samples=[(epoch - 1) * n * world + k for k in samples],
                       losses=values)
    return values, seconds


def run_torch(config: TrainConfig, log: Log = print, *, resume: dict[str, Any] | None = None,
              stop: StopFlag | None = None) -> RunResult:
    """Run the seed experiment on PyTorch.

    Prints the seed's lines (``loss: x  [i/size]`` every ``log_every`` micro-batches, showing the
    last window's loss, and ``Test: Accuracy: x%, Avg loss: y`` per epoch), writes
    ``metrics.jsonl`` into ``config.out`` when given, and returns the per-epoch results. Inside
    an initialized process group (``gradaccum train`` under torchrun) every rank trains its
    DistributedSampler share through DDP; rank 0 prints and writes.

    With ``config.checkpoint_every`` it writes ``out/checkpoint.pt`` every that many optimizer
    steps (see :mod:`gradaccum.run_folder.checkpoint`); with ``stop``, a signal makes it write one
    and raise :class:`~gradaccum.run_folder.interrupt.Interrupted` (between two micro-batches on one
    process; at the next window's start on several ranks or under window BatchNorm).

    Args:
        config: the settings.
        log: where the lines go.
        resume: a checkpoint (:func:`gradaccum.run_folder.checkpoint.load_checkpoint`, its settings
            checked by :func:`~gradaccum.run_folder.checkpoint.check_resumable`) to continue from.
        stop: the flag a signal sets (installed by the caller).

    Returns:
        The run's results, with the final parameters as numpy arrays.

    Raises:
        ConfigError: the data cannot be read, or the checkpoint does not fit.
        Interrupted: ``stop`` fired; the checkpoint is written (when ``config.out`` is set).
    """
    log = rank_log(log, current_ranks())
    run = _setup(config, log, resume, stop)
    result = run_epochs(
        config, log, run.writer, train_epoch=lambda epoch: _train_epoch(run, epoch),
        evaluate=lambda: evaluate(run.model, run.x_test, run.y_test),
        counters=lambda: (run.acc.optimizer_steps, run.acc.skipped_windows),
        peak_memory=lambda: _peak_memory(run.device), train_items=len(run.x), result=run.result)
    result.final_params = [p.detach().cpu().numpy() for p in run.model.parameters()]
    return result
