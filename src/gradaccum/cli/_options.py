"""Checked option values shared by the commands: argparse types, devices, output folders.

A bad value stops the command before anything runs, with one line naming the option and the
value (argparse reports a type's ``ArgumentTypeError`` as ``argument --epochs: ...``). Every
number has a range, its upper end included (docs/CLI.md lists them):

- counts of items, micro-batches or steps: 1 to :data:`MAX_COUNT` (2**24);
- ``--epochs``: 1 to :data:`MAX_EPOCHS`;
- ``--seed``: 0 to :data:`MAX_SEED` (2**32 - 1, what torch, NumPy and MindSpore all accept);
- ``--threads``: 1 to :data:`MAX_THREADS`;
- ``--lr``: above 0, up to :data:`MAX_LR`; tolerances: 0 to :data:`MAX_TOLERANCE`.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from gradaccum.cli._errors import UsageError, one_line

__all__ = ["MAX_COUNT", "MAX_EPOCHS", "MAX_LR", "MAX_SEED", "MAX_THREADS", "MAX_TOLERANCE",
           "add_data_argument", "check_count", "check_device", "epochs_int", "finite_float",
           "mnist_dir", "nonneg_int", "out_dir", "positive_float", "positive_int", "seed_int",
           "threads_int", "writable_dir"]

MAX_COUNT = 2**24  # items per batch, micro-batches per window, probe sizes, limits, intervals
MAX_EPOCHS = 10_000
MAX_SEED = 2**32 - 1  # torch (< 2**64), NumPy (< 2**32) and MindSpore seeds all accept it
MAX_THREADS = 1024
MAX_LR = 1e30  # beyond it a float32 update overflows for any gradient above 1e-8
MAX_TOLERANCE = 1e3


def plain_int(text: str) -> int | None:
    """``text`` as an integer if it is written plainly, else None: ASCII digits, no leading zero,
    sign, underscore or exponent ("3", not "03", "+3", "3_000", "3e3" or "٣").

    Example:
        >>> plain_int("3"), plain_int("03"), plain_int("٣")
        (3, None, None)
    """
    try:
        value = int(text)
    except ValueError:
        return None
    return value if str(value) == text else None


def _int(text: str, minimum: int, maximum: int) -> int:
    """``text`` as an integer from ``minimum`` to ``maximum``, written plainly (:func:`plain_int`)."""
    value = plain_int(text.strip())
    if value is None or value < minimum:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
    if value > maximum:
        raise argparse.ArgumentTypeError(f"must be an integer <= {maximum}, got {text!r}")
    return value


def check_count(value: int, what: str, maximum: int = MAX_COUNT) -> int:
    """``value`` if it is at most ``maximum``; for counts parsed inside a larger option's text
    (``--settings``, ``--steps-schedule``, ``--input-shape``).

    Raises:
        ValueError: above ``maximum``, naming ``what``.

    Example:
        >>> check_count(64, "--settings micro-batch")
        64
    """
    if value > maximum:
        raise ValueError(f"{what} must be <= {maximum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a count, an integer from 1 to :data:`MAX_COUNT`.

    Example:
        >>> positive_int("3")
        3
    """
    return _int(text, 1, MAX_COUNT)


def nonneg_int(text: str) -> int:
    """An argparse type: an integer from 0 to :data:`MAX_COUNT`."""
    return _int(text, 0, MAX_COUNT)


def epochs_int(text: str) -> int:
    """An argparse type: a number of epochs, 1 to :data:`MAX_EPOCHS`."""
    return _int(text, 1, MAX_EPOCHS)


def seed_int(text: str) -> int:
    """An argparse type: a seed, 0 to :data:`MAX_SEED`.

    Example:
        >>> seed_int("4294967295")
        4294967295
    """
    return _int(text, 0, MAX_SEED)


def threads_int(text: str) -> int:
    """An argparse type: a thread count, 1 to :data:`MAX_THREADS`."""
    return _int(text, 1, MAX_THREADS)


def out_dir(text: str) -> Path:
    """An argparse type: an output folder's name, not empty (``--out ''`` would write into the
    current folder).

    Example:
        >>> out_dir("runs/a")
        PosixPath('runs/a')
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name a folder, got {text!r}")
    return Path(text)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def finite_float(text: str) -> float:
    """An argparse type: a tolerance, a number from 0 to :data:`MAX_TOLERANCE`."""
    value = _float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    if value > MAX_TOLERANCE:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_TOLERANCE:g}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a learning rate, a number above 0 and at most :data:`MAX_LR`.

    Example:
        >>> positive_float("1e-3")
        0.001
    """
    value = _float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    if value > MAX_LR:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_LR:g}, got {text!r}")
    return value


def check_device(text: str, option: str = "--device") -> str:
    """Check that a torch device exists on this machine.

    Raises:
        UsageError: not a device name, or a device this machine does not have (``cpu:1``
            included: the CPU is one device).

    Example:
        >>> check_device("cpu")
        'cpu'
    """
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as err:
        raise UsageError(f"{option} {text!r} is not a device name ({one_line(err)})") from None
    if device.type == "cpu":
        if device.index not in (None, 0):  # torch accepts any index and runs on the one CPU device
            raise UsageError(f"{option} {text}: the CPU is one device, cpu or cpu:0")
        return text
    backend = getattr(torch, device.type, None)
    if device.type == "mps":
        backend = getattr(torch.backends, "mps", None)
    available = bool(backend is not None and getattr(backend, "is_available", lambda: False)())
    if not available:
        raise UsageError(f"{option} {text}: this machine has no {device.type} device "
                         f"(torch {torch.__version__}); use --device cpu")
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        raise UsageError(f"{option} {text}: this machine has {count} {device.type} device(s)")
    return text


def add_data_argument(parser: argparse.ArgumentParser) -> argparse.Action:
    """Add ``--data DIR`` (also spelled ``--data-dir``, its 0.2.0 name) to a command that reads
    MNIST."""
    return parser.add_argument(
        "--data", "--data-dir", dest="data_dir", type=Path, default=None, metavar="DIR",
        help="a folder with the four MNIST .gz files (default: the data/mnist of the checkout "
             "gradaccum runs from or in, else the cache that `gradaccum data mnist` fills)")


def mnist_dir(data_dir: Path | None) -> Path:
    """The MNIST folder a command will read, found before anything runs: ``--data DIR``, else
    the checkout's copy, else the user's cache (:func:`gradaccum.demos.data_dirs.find_mnist`).

    Raises:
        UsageError: ``--data DIR`` lacks a file, or no copy is found; one line saying how to get it.
    """
    from gradaccum.demos.data_dirs import MnistNotFoundError, find_mnist

    try:
        return find_mnist(data_dir)
    except MnistNotFoundError as err:
        raise UsageError(str(err)) from None


def writable_dir(path: Path, option: str = "--out") -> Path:
    """Create ``path`` if needed and check that files can be written in it.

    Raises:
        UsageError: it cannot be created (a file in the way, no permission) or written.
    """
    probe = path / f".gradaccum-write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"{option} {path} is not a writable folder ({err.strerror or err})") from None
    return path
