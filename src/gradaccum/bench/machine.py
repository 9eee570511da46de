"""The machine and versions a benchmark ran on, as every benchmark table states them.

Lives in ``bench`` (not ``cli``) so that the benchmarks can print it without importing a higher
floor; ``gradaccum info`` prints the same dictionary.
"""

from __future__ import annotations

import os
import platform

__all__ = ["describe_machine"]


def _cpu_model() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
        "cpu": _cpu_model(),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "malloc": " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                           if k.startswith("MALLOC_")) or "defaults",
    }
