"""``gradaccum bench``: time, memory and exactness against the alternatives; writes a report."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from gradaccum.cli._options import (
    add_data_argument,
    check_device,
    mnist_dir,
    out_dir,
    threads_int,
    writable_dir,
)

__all__ = ["add_parser"]


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (the options that differ from the defaults)."""
    words = ["gradaccum", "bench"]
    if args.out != Path("docs"):
        words += ["--out", str(args.out)]
    words += ["--smoke"] if args.smoke else []
    words += ["--device", args.device] if args.device != "cpu" else []
    words += ["--threads", str(args.threads)] if args.threads is not None else []
    words += [] if args.malloc_compare else ["--no-malloc-compare"]
    words += ["--data", str(args.data_dir)] if args.data_dir is not None else []
    return shlex.join(words)


def _run(args: argparse.Namespace) -> int:
    from gradaccum.bench.run import run_bench

    data = mnist_dir(args.data_dir)  # the MLP's tasks read MNIST
    check_device(args.device)
    writable_dir(args.out)
    path = run_bench(args.out, smoke=args.smoke, device=args.device, threads=args.threads,
                     malloc_compare=args.malloc_compare, command=_command(args), data_dir=data)
    print(f"Wrote {path}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``bench``."""
    p = sub.add_parser(
        "bench", help="benchmark against a hand-written loop, Accelerate and the seed's accumulator",
        description="Time per optimizer step and allocator peaks against a hand-written loop and "
                    "Hugging Face Accelerate, memory against micro-batch, exactness against the "
                    "full batch, and the seed's accumulator's buffers. Writes BENCHMARKS.md and "
                    "PNG figures (minutes on 2 CPU cores; --smoke: seconds).")
    p.add_argument("--out", type=out_dir, default=Path("docs"),
                   help="folder for BENCHMARKS.md and the figures (default: docs)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: proves it runs, in seconds")
    p.add_argument("--device", default="cpu", help="cpu or cuda (exactness always runs on CPU)")
    p.add_argument("--threads", type=threads_int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--malloc-compare", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the memory sweep with MALLOC_MMAP_MAX_=0 and a large "
                        "MALLOC_TRIM_THRESHOLD_, in a child process (CPU; default: on)")
    add_data_argument(p)
    p.set_defaults(func=_run)
