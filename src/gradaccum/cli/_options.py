"""Checked option values shared by the commands: argparse types, devices, output folders.

A bad value stops the command before anything runs, with one line naming the option and the
value (argparse reports a type's ``ArgumentTypeError`` as ``argument --epochs: ...``).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from gradaccum.cli._errors import UsageError, one_line

__all__ = ["check_device", "finite_float", "nonneg_int", "positive_float", "positive_int",
           "writable_dir"]


def _int(text: str, minimum: int, what: str) -> int:
    """``text`` as an integer >= ``minimum``, written plainly ("3", not "03", "+3" or "3_000")."""
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum or str(value) != text.strip():
        raise argparse.ArgumentTypeError(f"must be an integer {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1.

    Example:
        >>> positive_int("3")
        3
    """
    return _int(text, 1, ">= 1")


def nonneg_int(text: str) -> int:
    """An argparse type: an integer >= 0 (a seed)."""
    return _int(text, 0, ">= 0")


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def finite_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (a tolerance)."""
    value = _float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a learning rate).

    Example:
        >>> positive_float("1e-3")
        0.001
    """
    value = _float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def check_device(text: str, option: str = "--device") -> str:
    """Check that a torch device exists on this machine.

    Raises:
        UsageError: not a device name, or a device this machine does not have.

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
