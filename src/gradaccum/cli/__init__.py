"""The ``gradaccum`` command line: one small module per command, the top floor.

May import: gradaccum.core, gradaccum.torch, gradaccum.contrastive, gradaccum.mindspore,
gradaccum.run_folder, gradaccum.demos, gradaccum.bench

Each command module exposes ``add_parser(subparsers)``, which registers its parser and sets
``func`` (called with the parsed arguments, returning the exit code). Command modules import
their heavy parts inside ``func``, so building the parser stays cheap. Whatever a command
raises becomes one line and an exit code in one place, :mod:`gradaccum.cli._errors`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from gradaccum.cli._errors import EXIT_USAGE, Parser, run_command

__all__ = ["COMMANDS", "build_parser", "main"]

# name -> module (each registers its own parser and help). Modules are imported lazily.
COMMANDS: dict[str, str] = {
    "train": "gradaccum.cli.train",
    "compare": "gradaccum.cli.compare",
    "bench": "gradaccum.cli.bench",
    "info": "gradaccum.cli.info",
    "check": "gradaccum.cli.check",
    "plan": "gradaccum.cli.plan",
    "data": "gradaccum.cli.data",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per command."""
    from gradaccum import __version__

    parser = Parser(
        prog="gradaccum",
        description="Exact gradient accumulation: a large effective batch from small micro-batches. "
                    "Exit codes: 0 done, 1 failed, 2 bad usage, 3 (check) the model raised, "
                    "130/143 interrupted (docs/CLI.md).",
    )
    parser.add_argument("--version", action="version", version=f"gradaccum {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (also GRADACCUM_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(COMMANDS[name])
        module.add_parser(sub)
        # SUPPRESS: a command's parser leaves the top-level --debug alone unless given itself.
        sub.choices[name].add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                       help="show the traceback of an error (also GRADACCUM_DEBUG=1)")
    return parser


def _torch_importable() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    Example:
        >>> main(["info"])  # doctest: +SKIP
        0
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print("gradaccum: interrupted (SIGINT)", file=sys.stderr)
        return 130
    except SystemExit as done:  # --help, --version, or a usage error already printed in one line
        return done.code if isinstance(done.code, int) else 2
    except ImportError as err:
        # Every command runs PyTorch demo models (the mindspore backend starts from their weights),
        # so the commands load torch; without it, one line naming what to install, as for an extra.
        if _torch_importable():
            raise
        print(f"gradaccum: the command line needs torch: pip install torch ({err})", file=sys.stderr)
        return EXIT_USAGE
    if args.command is None:
        parser.print_help()
        return 2
    args.argv = argv
    return run_command(f"gradaccum {args.command}", args.func, args)
