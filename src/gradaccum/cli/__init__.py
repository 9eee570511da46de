"""The ``gradaccum`` command line: one small module per command.

Each command module exposes ``add_parser(subparsers)``, which registers its parser and sets
``func`` (called with the parsed arguments, returning the exit code). Command modules import
their heavy parts inside ``func``, so building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["COMMANDS", "build_parser", "main"]

# name -> (module, one-line help). Modules are imported lazily.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("gradaccum.cli.train", "run the seed experiment (MNIST) through the Accumulator"),
    "compare": ("gradaccum.cli.compare", "run the seed experiment at several micro x steps settings"),
    "bench": ("gradaccum.cli.bench",
              "benchmark against a hand-written loop, Accelerate and the seed's accumulator"),
    "info": ("gradaccum.cli.info", "print versions, threads and devices"),
    "check": ("gradaccum.cli.check", "is accumulation exact for a model? (full batch vs N micro-batches)"),
    "plan": ("gradaccum.cli.plan", "predict memory per micro-batch; recommend micro-batch x steps"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per command."""
    from gradaccum import __version__

    parser = argparse.ArgumentParser(
        prog="gradaccum",
        description="Exact gradient accumulation: a large effective batch from small micro-batches.",
    )
    parser.add_argument("--version", action="version", version=f"gradaccum {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(COMMANDS[name][0])
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    Example:
        >>> main(["info"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
