"""``gradaccum train``: the seed experiment (MNIST, MLP 784-512-512-10, 32 x 2 steps, 3 epochs)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradaccum.core import check_positive_int, lr_scale, parse_schedule, resolve_batch_sizes
from gradaccum.demos.config import BN_MODES, RunResult, TrainConfig

if TYPE_CHECKING:
    from gradaccum.demos.distributed import Ranks

__all__ = ["add_experiment_arguments", "add_parser", "config_from_args", "run_config"]

SEED_MICRO_BATCH, SEED_STEPS = 32, 2


def add_experiment_arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add the options every experiment command shares (all but the batch split).

    Returns:
        The added actions, so that ``compare`` can pass them on to each ``train`` run.
    """
    actions: list[argparse.Action] = []

    def add(*flags: str, **kwargs: Any) -> None:
        actions.append(parser.add_argument(*flags, **kwargs))

    add("--model", default="mlp", choices=["mlp", "cnn", "cnn-bn"],
        help="the network (default: the seed's MLP 784-512-512-10)")
    add("--bn", default="plain", choices=list(BN_MODES),
        help="BatchNorm under accumulation: plain, compound or linear momentum, window "
             "(running stats of the whole batch), groupnorm (see docs/BATCHNORM.md)")
    add("--init", default="torch", choices=["torch", "mindspore"],
        help="mindspore: N(0, 0.01) linear weights and zero bias, the tutorial's defaults")
    add("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    add("--lr-rule", default="none", choices=["none", "linear", "sqrt"],
        help="scale --lr from --base-batch to the effective batch (gradaccum.lr_scale)")
    add("--base-batch", type=int, default=64, help="the batch --lr was tuned for")
    add("--optimizer", default="sgd", choices=["sgd", "momentum", "adam", "adamw"])
    add("--epochs", type=int, default=3)
    add("--seed", type=int, default=0, help="weights and data order")
    add("--end-of-epoch", default="flush", choices=["flush", "carry"],
        help="flush the partial window, or carry it into the next epoch")
    add("--data-dir", type=Path, default=None,
        help="a folder with the four MNIST .gz files (default: the shipped copy)")
    add("--limit-train", type=int, default=None, help="use the first N training items")
    add("--limit-test", type=int, default=None, help="use the first N test items")
    add("--precision", default="fp32", choices=["fp32", "bf16"],
        help="bf16: forward under torch.autocast(bfloat16), float32 parameters; windows with a "
             "non-finite gradient are skipped and counted (skipped_windows)")
    add("--backend", default="torch", choices=["torch", "mindspore"],
        help="mindspore: the same run through gradaccum.mindspore inside @ms.jit (CPU, fp32; "
             "needs pip install 'gradaccum[mindspore]')")
    add("--device", default="cpu", help="cpu, cuda, cuda:1 (torch backend)")
    add("--log-every", type=int, default=100, help="print a loss line every N micro-batches")
    add("--progress", action=argparse.BooleanOptionalAction, default=None,
        help="progress bar (default: when stderr is a terminal)")
    return actions


def config_from_args(args: argparse.Namespace, micro_batch: int, steps: int | str,
                     out: Path | None, world: int = 1) -> TrainConfig:
    """Build a :class:`TrainConfig` from parsed experiment options and a batch split (``steps``:
    an int, or a schedule string such as ``"0:4,2:2"``; ``world``: ranks under torchrun)."""
    lr = args.lr
    if args.lr_rule != "none":
        if isinstance(steps, str):
            raise ValueError("--lr-rule scales to one effective batch: it needs a constant --steps, "
                             f"not the schedule {steps!r}")
        lr = lr_scale(args.lr, args.base_batch, micro_batch * steps * world, rule=args.lr_rule)
    return TrainConfig(
        model=args.model, bn=args.bn, init=args.init, micro_batch=micro_batch, steps=steps, lr=lr,
        optimizer=args.optimizer, epochs=args.epochs, seed=args.seed, end_of_epoch=args.end_of_epoch,
        data_dir=args.data_dir, limit_train=args.limit_train, limit_test=args.limit_test,
        precision=args.precision, backend=args.backend, device=args.device,
        log_every=args.log_every,
        progress=sys.stderr.isatty() if args.progress is None else args.progress, out=out)


def run_config(config: TrainConfig) -> RunResult:
    """Run one experiment on its backend, and write its summary and plot into ``config.out``."""
    if config.backend == "mindspore":
        from gradaccum.demos.mindspore_trainer import run_mindspore

        result = run_mindspore(config)
    else:
        from gradaccum.demos.trainer import run_torch

        result = run_torch(config)
    if config.out is not None:
        _write_outputs(result, config.out)
    return result


def _write_outputs(result: RunResult, out: Path) -> None:
    import numpy as np

    from gradaccum.demos.metrics import plot_runs, read_metrics, write_summary

    write_summary(result, out)
    np.savez(out / "params.npz", *result.final_params)
    plot_runs([(result.config.label, read_metrics(out / "metrics.jsonl"))], out / "curves.png",
              title=f"gradaccum train: {result.config.model}, {result.config.label}")


def _scheduled(args: argparse.Namespace) -> tuple[int, str]:
    """The batch split under ``--steps-schedule``: the micro-batch and the schedule string."""
    if args.steps is not None or args.global_batch is not None:
        raise ValueError("--steps-schedule replaces --steps and --global-batch")
    parse_schedule(args.steps_schedule)  # reject a bad schedule before any data is loaded
    micro = SEED_MICRO_BATCH if args.micro_batch is None else args.micro_batch
    return check_positive_int("micro_batch", micro), args.steps_schedule


def _run(args: argparse.Namespace) -> int:
    if args.backend == "mindspore":
        from gradaccum.demos.mindspore_trainer import init_msrun

        return _as_rank(args, init_msrun())  # every worker under msrun, else one process
    from gradaccum.demos.distributed import init_from_env

    ranks = init_from_env(args.device)  # several ranks under torchrun, else one process
    if ranks.world == 1:
        return _run_ranks(args, 1)
    import torch.distributed as dist

    try:
        return _as_rank(args, ranks)
    finally:
        dist.destroy_process_group()


def _as_rank(args: argparse.Namespace, ranks: Ranks) -> int:
    """Run on this rank: rank 0 prints and writes for every rank, the others run quietly."""
    if ranks.main:
        return _run_ranks(args, ranks.world)
    args.out = None
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        return _run_ranks(args, ranks.world)


def _run_ranks(args: argparse.Namespace, world: int) -> int:
    if args.steps_schedule is not None:
        try:
            micro, schedule = _scheduled(args)
            config = config_from_args(args, micro, schedule, args.out, world=world)
        except (TypeError, ValueError) as err:
            args.parser.error(str(err))
        print(f"gradaccum train: {config.model}, micro-batch {micro} x steps scheduled {schedule} "
              f"(start:N, by optimizer step), lr {config.lr:g}, {config.optimizer}, "
              f"{config.epochs} epoch(s)")
        return _report(run_config(config), config)
    micro, steps, global_batch = args.micro_batch, args.steps, args.global_batch
    if global_batch is None:
        micro = SEED_MICRO_BATCH if micro is None else micro
        steps = SEED_STEPS if steps is None else steps
    elif micro is None and steps is None:
        micro = SEED_MICRO_BATCH
    try:
        micro, steps = resolve_batch_sizes(micro, steps, global_batch, world_size=world)
        config = config_from_args(args, micro, steps, args.out, world=world)
    except (TypeError, ValueError) as err:
        args.parser.error(str(err))
    ranks = f" x {world} ranks" if world > 1 else ""
    print(f"gradaccum train: {config.model}, micro-batch {micro} x steps {steps}{ranks} = batch "
          f"{micro * steps * world}, lr {config.lr:g}, {config.optimizer}, {config.epochs} epoch(s)")
    return _report(run_config(config), config)


def _report(result: RunResult, config: TrainConfig) -> int:
    last = result.epochs[-1] if result.epochs else None
    if last is not None:
        print(f"Done: {last.test_accuracy:.1f}% after {last.epoch} epoch(s), "
              f"{result.seconds:.1f} s" + (f", outputs in {config.out}" if config.out else ""))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``train``."""
    p = sub.add_parser("train", help="run the seed experiment (MNIST) through the Accumulator",
                       description="The seed experiment: MNIST, micro-batch x steps, exact "
                                   "gradient accumulation. Give two of --micro-batch, --steps and "
                                   "--global-batch (default 32 x 2). Under torchrun "
                                   "(torchrun --nproc-per-node 2 -m gradaccum train ...) every "
                                   "rank trains its DistributedSampler share through DDP, and "
                                   "--global-batch counts every rank's items; --backend mindspore "
                                   "does the same under msrun (msrun --worker_num 2 "
                                   "--local_worker_num 2 ... python -m gradaccum train ...).")
    p.add_argument("--micro-batch", type=int, default=None, help="items per micro-batch (default 32)")
    p.add_argument("--steps", type=int, default=None, help="micro-batches per window (default 2)")
    p.add_argument("--global-batch", type=int, default=None, help="micro-batch x steps")
    p.add_argument("--steps-schedule", default=None, metavar="START:N,...",
                   help="change --steps during training, at window boundaries: '0:4,2:2' is 4 "
                        "micro-batches per window for the first 2 optimizer steps, then 2")
    add_experiment_arguments(p)
    p.add_argument("--out", type=Path, default=None,
        help="write metrics.jsonl, summary.json, params.npz and curves.png here")
    p.set_defaults(func=_run, parser=p)
