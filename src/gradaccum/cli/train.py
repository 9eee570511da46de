"""``gradaccum train``: the seed experiment (MNIST, MLP 784-512-512-10, 32 x 2 steps, 3 epochs).

Long runs: ``--checkpoint-every N`` writes ``OUT/checkpoint.pt`` every N optimizer steps,
Ctrl-C or SIGTERM writes one and exits 130 or 143, and ``--resume`` continues from it,
bitwise equal to a run never stopped (see :mod:`gradaccum.run_folder.checkpoint`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from gradaccum.cli._errors import UsageError
from gradaccum.cli._options import (
    add_data_argument,
    check_count,
    check_device,
    epochs_int,
    mnist_dir,
    out_dir,
    positive_float,
    positive_int,
    seed_int,
)
from gradaccum.cli._train_folder import folder_lock, prepare_out
from gradaccum.core import lr_scale, parse_schedule, resolve_batch_sizes
from gradaccum.demos.config import BN_MODES, RunResult, TrainConfig
from gradaccum.demos.distributed import Ranks
from gradaccum.run_folder.interrupt import Interrupted, StopFlag
from gradaccum.run_folder.outputs import (
    CHECKPOINT,
    atomic_write,
)

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
    add("--lr", type=positive_float, default=0.01, help="learning rate (default 0.01)")
    add("--lr-rule", default="none", choices=["none", "linear", "sqrt"],
        help="scale --lr from --base-batch to the effective batch (gradaccum.lr_scale)")
    add("--base-batch", type=positive_int, default=64, help="the batch --lr was tuned for")
    add("--optimizer", default="sgd", choices=["sgd", "momentum", "adam", "adamw"])
    add("--epochs", type=epochs_int, default=3)
    add("--seed", type=seed_int, default=0, help="weights and data order")
    add("--end-of-epoch", default="flush", choices=["flush", "carry"],
        help="flush the partial window, or carry it into the next epoch")
    actions.append(add_data_argument(parser))
    add("--limit-train", type=positive_int, default=None, help="use the first N training items")
    add("--limit-test", type=positive_int, default=None, help="use the first N test items")
    add("--precision", default="fp32", choices=["fp32", "bf16"],
        help="bf16: forward under torch.autocast(bfloat16), float32 parameters; windows with a "
             "non-finite gradient are skipped and counted (skipped_windows)")
    add("--backend", default="torch", choices=["torch", "mindspore"],
        help="mindspore: the same run through gradaccum.mindspore inside @ms.jit (CPU, fp32; "
             "needs pip install 'gradaccum[mindspore]')")
    add("--device", default="cpu", help="cpu, cuda, cuda:1 (torch backend)")
    add("--log-every", type=positive_int, default=100, help="print a loss line every N micro-batches")
    add("--progress", action=argparse.BooleanOptionalAction, default=None,
        help="progress bar (default: when stderr is a terminal)")
    return actions


def config_from_args(args: argparse.Namespace, micro_batch: int, steps: int | str,
                     out: Path | None, world: int = 1) -> TrainConfig:
    """Build a :class:`TrainConfig` from parsed experiment options and a batch split (``steps``:
    an int, or a schedule string such as ``"0:4,2:2"``; ``world``: ranks under torchrun).

    Raises:
        UsageError: ``--lr-rule`` with a schedule.
    """
    lr = args.lr
    if args.lr_rule != "none":
        if isinstance(steps, str):
            raise UsageError("--lr-rule scales to one effective batch: it needs a constant --steps, "
                             f"not the schedule {steps!r}")
        lr = lr_scale(args.lr, args.base_batch, micro_batch * steps * world, rule=args.lr_rule)
    return TrainConfig(
        model=args.model, bn=args.bn, init=args.init, micro_batch=micro_batch, steps=steps, lr=lr,
        optimizer=args.optimizer, epochs=args.epochs, seed=args.seed, end_of_epoch=args.end_of_epoch,
        data_dir=args.data_dir, limit_train=args.limit_train, limit_test=args.limit_test,
        precision=args.precision, backend=args.backend, device=args.device,
        log_every=args.log_every,
        progress=sys.stderr.isatty() if args.progress is None else args.progress, out=out,
        checkpoint_every=getattr(args, "checkpoint_every", None))


def run_config(config: TrainConfig, *, resume: dict[str, Any] | None = None,
               stop: StopFlag | None = None, write: bool = True) -> RunResult:
    """Run one experiment on its backend; write its final files into ``config.out`` (atomically)
    and drop its checkpoint, which a finished run no longer needs.

    Args:
        config: the settings.
        resume: a checked checkpoint to continue from (torch backend).
        stop: the flag a signal sets; the run then checkpoints and raises ``Interrupted``.
        write: write the final files (False on ranks other than 0).
    """
    if config.backend == "mindspore":
        result: RunResult = _mindspore_trainer().run_mindspore(config)
    else:
        from gradaccum.demos.trainer import run_torch

        result = run_torch(config, resume=resume, stop=stop)
    if config.out is not None and write:
        _write_outputs(result, config.out)
        (config.out / CHECKPOINT).unlink(missing_ok=True)
    return result


def _write_outputs(result: RunResult, out: Path) -> None:
    import numpy as np

    from gradaccum.demos.metrics import plot_runs, read_metrics, write_summary

    write_summary(result, out)
    atomic_write(out / "params.npz", lambda tmp: np.savez(tmp, *result.final_params))
    plot_runs([(result.config.label, read_metrics(out / "metrics.jsonl"))], out / "curves.png",
              title=f"gradaccum train: {result.config.model}, {result.config.label}")


def _check_schedule(text: str) -> None:
    """Refuse a ``--steps-schedule`` that does not parse, or whose starts or sizes exceed
    :data:`~gradaccum.cli._options.MAX_COUNT`."""
    try:
        table = parse_schedule(text).table()
        assert table is not None, "a parsed string has a table"
        for start, size in zip(*table, strict=True):
            check_count(start, "--steps-schedule start")
            check_count(size, "--steps-schedule N")
    except ValueError as err:
        raise UsageError(str(err)) from None


def _config(args: argparse.Namespace, world: int) -> tuple[TrainConfig, str]:
    """The run's settings and its header's batch description, from the batch options."""
    if args.steps_schedule is not None:
        if args.steps is not None or args.global_batch is not None:
            raise UsageError("--steps-schedule replaces --steps and --global-batch")
        _check_schedule(args.steps_schedule)  # reject a bad schedule before any data is loaded
        micro = SEED_MICRO_BATCH if args.micro_batch is None else args.micro_batch
        config = config_from_args(args, micro, args.steps_schedule, args.out, world=world)
        return config, (f"micro-batch {micro} x steps scheduled {args.steps_schedule} "
                        "(start:N, by optimizer step)")
    micro, steps, global_batch = args.micro_batch, args.steps, args.global_batch
    if global_batch is None:
        micro = SEED_MICRO_BATCH if micro is None else micro
        steps = SEED_STEPS if steps is None else steps
    elif micro is None and steps is None:
        micro = SEED_MICRO_BATCH
    try:
        micro, steps = resolve_batch_sizes(micro, steps, global_batch, world_size=world)
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from None
    ranks = f" x {world} ranks" if world > 1 else ""
    return (config_from_args(args, micro, steps, args.out, world=world),
            f"micro-batch {micro} x steps {steps}{ranks} = batch {micro * steps * world}")


def _resume_line(args: argparse.Namespace, stop: Interrupted, world: int) -> str:
    name = signal.Signals(stop.signum).name
    if stop.checkpoint is None:
        return f"interrupted by {name} {stop.where}; nothing saved (no --out)"
    if world > 1:
        how = "the same torchrun command with --resume"
    else:
        words = [w for w in args.argv if w != "--overwrite"]
        how = shlex.join(["gradaccum", *words, *([] if "--resume" in words else ["--resume"])])
    return (f"interrupted by {name} {stop.where}; checkpoint written to {stop.checkpoint}; "
            f"resume with: {how}")


def _mindspore_trainer() -> ModuleType:
    """``gradaccum.demos.mindspore_trainer``, or a usage error naming the extra to install."""
    try:
        from gradaccum.demos import mindspore_trainer
    except ImportError as err:
        raise UsageError(f"--backend mindspore needs MindSpore ({err}): "
                         "pip install 'gradaccum[mindspore]'") from None
    return mindspore_trainer


def _run(args: argparse.Namespace) -> int:
    from gradaccum.demos.distributed import init_from_env
    from gradaccum.demos.extras import require_demo_extra

    mnist_dir(args.data_dir)  # without data, say how to get it before anything else
    require_demo_extra()
    check_device(args.device)
    if args.backend == "mindspore":
        if args.resume or args.checkpoint_every:
            raise UsageError("--backend mindspore does not write checkpoints: drop --checkpoint-every "
                             "and --resume (or train with --backend torch)")
        ranks = _mindspore_trainer().init_msrun()  # every worker under msrun, else one process
        if not ranks.main:
            args.out = None  # rank 0 writes for every rank
        return _as_rank(args, ranks)
    ranks = init_from_env(args.device)  # several ranks under torchrun, else one process
    if ranks.world == 1:
        return _run_ranks(args, ranks)
    import torch.distributed as dist

    try:
        code = _as_rank(args, ranks)
        dist.barrier()  # no rank tears the group down while another still talks through it
        return code
    finally:
        dist.destroy_process_group()


def _as_rank(args: argparse.Namespace, ranks: Ranks) -> int:
    """Run on this rank: rank 0 prints and writes for every rank, the others run quietly."""
    if ranks.main:
        return _run_ranks(args, ranks)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        return _run_ranks(args, ranks)


def _run_ranks(args: argparse.Namespace, ranks: Ranks) -> int:
    config, batch = _config(args, ranks.world)
    with folder_lock(args, ranks, config.backend) as killed_run:
        return _train_in_folder(args, config, batch, ranks, killed_run)


def _train_in_folder(args: argparse.Namespace, config: TrainConfig, batch: str, ranks: Ranks,
                     killed_run: bool) -> int:
    resume = prepare_out(args, config, ranks, killed_run)
    print(f"gradaccum train: {config.model}, {batch}, lr {config.lr:g}, {config.optimizer}, "
          f"{config.epochs} epoch(s)" + (f", resuming the run in {config.out}" if resume else ""))
    # The torch trainer stops at a point of its choosing and checkpoints; the MindSpore one
    # cannot, so there Ctrl-C raises KeyboardInterrupt as usual (exit 130, nothing saved).
    with StopFlag() if config.backend == "torch" else contextlib.nullcontext() as stop:
        try:
            result = run_config(config, resume=resume, stop=stop, write=ranks.main)
        except Interrupted as err:
            if not err.where:  # stopped outside the training loop: nothing to resume from
                raise
            raise Interrupted(err.signum, err.checkpoint, _resume_line(args, err, ranks.world),
                              where=err.where) from None
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
                                   "--local_worker_num 2 ... python -m gradaccum train ...). Ctrl-C (or "
                                   "SIGTERM) writes a checkpoint into --out and exits 130 (143); "
                                   "--resume continues it.")
    p.add_argument("--micro-batch", type=positive_int, default=None,
                   help="items per micro-batch (default 32)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="micro-batches per window (default 2)")
    p.add_argument("--global-batch", type=positive_int, default=None, help="micro-batch x steps")
    p.add_argument("--steps-schedule", default=None, metavar="START:N,...",
                   help="change --steps during training, at window boundaries: '0:4,2:2' is 4 "
                        "micro-batches per window for the first 2 optimizer steps, then 2")
    add_experiment_arguments(p)
    p.add_argument("--out", type=out_dir, default=None,
        help="write metrics.jsonl, summary.json, params.npz and curves.png here (one run per "
             "folder)")
    p.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="N",
                   help="write OUT/checkpoint.pt every N optimizer steps (torch backend)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its checkpoint; give the run's own arguments")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run files already in --out (without it, such a folder is refused)")
    p.set_defaults(func=_run)
