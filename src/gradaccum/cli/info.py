"""``gradaccum info``: the machine and versions, as every benchmark table states them."""

from __future__ import annotations

import argparse
import os
import platform

__all__ = ["add_parser", "describe_machine"]


def describe_machine() -> dict[str, str]:
    """Machine, versions, threads and malloc settings, for benchmark headers.

    Example:
        >>> "torch" in describe_machine()
        True
    """
    import torch

    from gradaccum import __version__

    return {
        "gradaccum": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "malloc": " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                           if k.startswith("MALLOC_")) or "defaults",
    }


def _run(args: argparse.Namespace) -> int:
    for key, value in describe_machine().items():
        print(f"{key:>14}: {value}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``info``."""
    p = sub.add_parser("info", help="print versions, threads and devices")
    p.set_defaults(func=_run)
