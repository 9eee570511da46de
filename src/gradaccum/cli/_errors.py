"""How every command fails: one line on stderr, an exit code, a traceback only when asked.

Exit codes, the same for every command:

- 0: done (``check``: equivalent);
- 1: a failure while running (``check``: not equivalent; a full disk);
- 2: bad usage: an argument's value, a file that is missing or not what it should be, a device
  that is not there, an output folder that cannot be written (argparse's own errors included);
- 3: ``check`` only: the model itself raised;
- 130, 143: interrupted by SIGINT (Ctrl-C) or SIGTERM (128 + the signal's number).

``--debug`` (or ``GRADACCUM_DEBUG=1``) prints the traceback before the line.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

from gradaccum.demos.config import ConfigError
from gradaccum.demos.extras import MissingExtraError
from gradaccum.run_folder.interrupt import Interrupted, handling
from gradaccum.run_folder.outputs import OutputError

__all__ = ["EXIT_FAILURE", "EXIT_MODEL", "EXIT_USAGE", "CommandError", "ModelError", "Parser",
           "UsageError", "model_raised", "one_line", "run_command"]

EXIT_FAILURE, EXIT_USAGE, EXIT_MODEL = 1, 2, 3


class CommandError(Exception):
    """A command's failure, reported as one line with :attr:`code` (default 1)."""

    code = EXIT_FAILURE


class UsageError(CommandError):
    """Bad usage: an argument's value, a missing or wrong file, a missing device (exit 2)."""

    code = EXIT_USAGE


class ModelError(CommandError):
    """The user's model raised (``gradaccum check``: exit 3)."""

    code = EXIT_MODEL


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``PROG: error: MESSAGE``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def one_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message, or its type's name."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def debug_requested(args: argparse.Namespace) -> bool:
    """``--debug`` was given, or ``GRADACCUM_DEBUG`` is set to something other than 0."""
    return bool(getattr(args, "debug", False)) or os.environ.get("GRADACCUM_DEBUG", "0") not in ("", "0")


def model_raised(error: BaseException, code_files: set[str]) -> bool:
    """Did ``error`` come out of a model: a module's forward, an autograd backward, or code in
    one of ``code_files`` (the file that defines a user's model factory)?"""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        code = frame.f_code
        path = code.co_filename.replace(os.sep, "/")
        if path.endswith("torch/nn/modules/module.py") and code.co_name in ("_call_impl",
                                                                           "_wrapped_call_impl"):
            return True
        if path.endswith("torch/autograd/graph.py") and code.co_name == "_engine_run_backward":
            return True
        if code.co_filename in code_files:
            return True
    return False


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    """SIGTERM as :class:`Interrupted` (exit 143, no traceback) while a command runs; commands
    that stop cleanly install their own handler over this one."""
    raise Interrupted(signum)


def _report(prog: str, line: str, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    print(f"{prog}: {line}", file=sys.stderr, flush=True)


def run_command(prog: str, func: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> int:
    """Run a command's function and turn whatever it raises into one line and an exit code.

    Args:
        prog: ``gradaccum COMMAND``, the line's prefix.
        func: the command, returning its exit code (``None``: 0).
        args: its parsed arguments (``args.debug`` asks for tracebacks).

    Returns:
        The exit code (see the module's docstring).

    Example:
        >>> def fails(args): raise UsageError("--epochs must be >= 1, got 0")
        >>> run_command("gradaccum train", fails, argparse.Namespace())
        2
    """
    debug = debug_requested(args)
    try:
        with handling(_raise_interrupted, (signal.SIGTERM,)):
            return int(func(args) or 0)
    except Interrupted as stop:
        _report(prog, str(stop), debug)
        return stop.exit_code
    except KeyboardInterrupt:
        _report(prog, "interrupted (SIGINT)", debug)
        return 128 + signal.SIGINT
    except CommandError as err:
        _report(prog, f"error: {one_line(err)}", debug)
        return err.code
    except (ConfigError, MissingExtraError) as err:
        _report(prog, f"error: {one_line(err)}", debug)
        return EXIT_USAGE
    except OutputError as err:  # a full disk: the run failed, the usage was fine
        _report(prog, f"error: {err.strerror}", debug)
        return EXIT_FAILURE
    except Exception as err:  # the point: no traceback, one line
        hint = "" if debug else " (--debug shows the traceback)"
        _report(prog, f"error: {type(err).__name__}: {one_line(err)}{hint}", debug)
        return EXIT_FAILURE
