"""Optional packages of the demo commands: progress bars (tqdm) and plots (matplotlib).

A training script needs neither, so ``pip install gradaccum`` leaves them out; the commands that
draw or show progress (``train``, ``compare``) check for them first and name the extra to install.
"""

from __future__ import annotations

import importlib.util

__all__ = ["DEMO_PACKAGES", "MissingExtraError", "require_demo_extra"]

DEMO_PACKAGES = ("tqdm", "matplotlib")


class MissingExtraError(ImportError):
    """An optional package a command needs is not installed."""


def require_demo_extra(packages: tuple[str, ...] = DEMO_PACKAGES) -> None:
    """Raise :class:`MissingExtraError` unless every package of the ``demo`` extra is installed.

    Nothing is imported: the check only looks the packages up.

    Raises:
        MissingExtraError: a one-line message naming the missing packages and the extra.

    Example:
        >>> require_demo_extra(("os",))
    """
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(
            f"{' and '.join(missing)} not installed (progress bars and plots): "
            "pip install 'gradaccum[demo]'")
