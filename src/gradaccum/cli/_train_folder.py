"""``gradaccum train``'s output folder: one run per folder, held by a lock while the run uses it;
a new run, ``--resume`` or ``--overwrite`` decided against what the folder holds."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

from gradaccum.cli._errors import UsageError
from gradaccum.cli._options import writable_dir
from gradaccum.demos.config import EpochResult, TrainConfig
from gradaccum.demos.distributed import Ranks
from gradaccum.run_folder.outputs import (
    CHECKPOINT,
    FINAL_FILES,
    RUN_FILES,
    clear_leftovers,
    clear_run,
    run_files_in,
)
from gradaccum.run_folder.run_lock import RunLockError, run_lock

__all__ = ["folder_lock", "prepare_out"]


def prepare_out(args: argparse.Namespace, config: TrainConfig, ranks: Ranks,
                killed_run: bool = False) -> dict[str, Any] | None:
    """Check ``--out`` against ``--resume`` and ``--overwrite``; the checkpoint to resume, if any.

    One folder holds one run: a new run refuses a folder with another run's files unless told
    to replace them; ``--resume`` continues the run there with the same settings. ``killed_run``:
    the folder's lock file was left by a run killed there (:func:`folder_lock` says), which with
    no checkpoint yet starts over like one that wrote only ``metrics.jsonl``.
    """
    from gradaccum.run_folder.checkpoint import check_resumable, load_checkpoint

    out = args.out
    if out is None:
        for flag, given in (("--resume", args.resume), ("--checkpoint-every", args.checkpoint_every)):
            if given:
                raise UsageError(f"{flag} needs --out, the run's folder")
        return None
    if ranks.main:  # the folder's lock is held: a temporary file there is a killed run's
        for name in RUN_FILES:
            clear_leftovers(out, name)
    held = run_files_in(out)
    restart = args.resume and (held or killed_run) and not set(held) & {CHECKPOINT, *FINAL_FILES}
    if restart:  # stopped before its first checkpoint: the latest state saved is the start
        print(f"No checkpoint in {out} yet: the run starts over")
    elif args.resume:
        state = load_checkpoint(out)
        check_resumable(state, config, ranks.world, results=EpochResult)
        writable_dir(out)
        if config.checkpoint_every is None:  # keep the run's own rhythm unless told otherwise
            config.checkpoint_every = state["config"].get("checkpoint_every")
        return state
    writable_dir(out)
    if held and not (args.overwrite or restart):
        raise UsageError(f"--out {out} holds another run ({', '.join(held)}): give --resume to "
                         "continue it or --overwrite to replace it")
    if ranks.world > 1 and config.backend == "torch":
        import torch.distributed as dist

        dist.barrier()  # every rank has looked before rank 0 removes anything
    if held and ranks.main:
        clear_run(out)
    return None


@contextlib.contextmanager
def folder_lock(args: argparse.Namespace, ranks: Ranks, backend: str) -> Iterator[bool]:
    """Hold ``--out``'s run lock (rank 0) while this run uses the folder: a second run into it
    exits 2 naming the first (:mod:`gradaccum.run_folder.run_lock`). Under torchrun every rank learns
    whether rank 0 got it, so that all of them stop together when it did not, and whether it
    found a killed run's lock file (yielded, for :func:`prepare_out`)."""
    out = args.out
    if out is None or (args.resume and not out.is_dir()):  # nothing to lock; prepare_out says why
        yield False
        return
    if ranks.main:
        writable_dir(out)
    with contextlib.ExitStack() as stack:
        failure: RunLockError | None = None
        killed_run = False
        if ranks.main:
            try:
                killed_run = stack.enter_context(run_lock(out))
            except RunLockError as err:
                failure = err
        if ranks.world > 1 and backend == "torch":
            import torch
            import torch.distributed as dist

            flag = torch.tensor([failure is not None, killed_run], dtype=torch.int32,
                                device=torch.device(args.device) if dist.get_backend() == "nccl" else "cpu")
            dist.broadcast(flag, src=0)
            if int(flag[0].item()) and failure is None:
                failure = RunLockError(f"--out {out}: rank 0 could not take its run lock (see rank 0's "
                                       "error)")
            killed_run = bool(flag[1].item())
        if failure is not None:
            raise failure
        yield killed_run
