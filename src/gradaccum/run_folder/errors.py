"""The refusal every part of a run shares: settings, data or a run folder it cannot start with."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """Settings or inputs a run cannot start with (missing or corrupt data, a checkpoint that does
    not fit): raised before anything trains. The command line reports it as bad usage (exit 2).

    Example:
        >>> isinstance(ConfigError("--data-dir: no MNIST files"), ValueError)
        True
    """
