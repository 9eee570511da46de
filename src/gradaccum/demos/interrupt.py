"""Stopping a run cleanly on Ctrl-C (SIGINT) or SIGTERM: a flag the training loop polls.

Python runs a signal handler between two bytecodes of the main thread, wherever that is. A
handler that raises (the default ``KeyboardInterrupt``) can stop a run half way through an
optimizer step; :class:`StopFlag` only records the signal, and the loop stops at a point of its
choosing (between two micro-batches), writes a checkpoint and raises :class:`Interrupted`.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

__all__ = ["SIGNALS", "Interrupted", "StopFlag"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A run stopped by a signal. Like ``KeyboardInterrupt``, not caught by ``except Exception``.

    Attributes:
        signum: the signal (``signal.SIGINT`` or ``signal.SIGTERM``).
        checkpoint: the checkpoint written before stopping, or ``None``.
        where: where a training loop stopped (``"at epoch 2, micro-batch 7 of 20"``), or ``""``.
        exit_code: ``128 + signum``, the shell's convention (130 for SIGINT, 143 for SIGTERM).

    Example:
        >>> Interrupted(signal.SIGTERM).exit_code
        143
    """

    def __init__(self, signum: int, checkpoint: Path | None = None, message: str = "", *,
                 where: str = "") -> None:
        name = signal.Signals(signum).name
        super().__init__(message or " ".join(filter(None, [f"interrupted ({name})", where])))
        self.signum = int(signum)
        self.checkpoint = checkpoint
        self.where = where

    @property
    def exit_code(self) -> int:
        """``128 + signum``."""
        return 128 + self.signum


class StopFlag:
    """Within ``with StopFlag() as stop:``, SIGINT and SIGTERM set ``stop.signum`` instead of
    raising; the previous handlers come back on exit. Elsewhere than in the main thread (where
    Python delivers signals) it installs nothing and never fires.

    Example:
        >>> with StopFlag() as stop:
        ...     stop.requested
        False
    """

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """True once a signal arrived."""
        return self.signum != 0

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
