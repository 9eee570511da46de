"""Stopping a run cleanly on Ctrl-C (SIGINT) or SIGTERM: a flag the training loop polls.

Python runs a signal handler between two bytecodes of the main thread, wherever that is. A
handler that raises (the default ``KeyboardInterrupt``) can stop a run half way through an
optimizer step; :class:`StopFlag` only records the signal, and the loop stops at a point of its
choosing (between two micro-batches), writes a checkpoint and raises :class:`Interrupted`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

__all__ = ["SIGNALS", "Interrupted", "StopFlag", "handling"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
Handler = Callable[[int, FrameType | None], Any]


@contextmanager
def handling(handler: Handler, signals: Sequence[int] = SIGNALS) -> Iterator[None]:
    """Handle ``signals`` with ``handler`` while the block runs, then restore the previous
    handlers; off the main thread (where Python cannot set handlers) it changes nothing.

    Example:
        >>> with handling(lambda signum, frame: None):
        ...     signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        True
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


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
        self._handling = handling(self._record)

    @property
    def requested(self) -> bool:
        """True once a signal arrived."""
        return self.signum != 0

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def __enter__(self) -> StopFlag:
        self._handling.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._handling.__exit__(kind, error, tb)
