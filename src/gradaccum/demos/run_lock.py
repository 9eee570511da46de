"""One run per output folder: ``OUT/.gradaccum.lock``, held while a run writes there.

The lock is an exclusive ``fcntl.flock`` on the file, which names its holder (pid, host, start
time) for the message a second run prints. The kernel releases a flock when its process ends,
however it ends, so a lock left by a killed run is free and the next run takes it over: no pid is
guessed alive or dead. Where ``fcntl`` is missing (Windows), the file is created with ``O_EXCL``
and a holder whose pid is no longer alive on this host is taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gradaccum.demos.config import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK", "RunLockError", "holder", "run_lock"]

LOCK = ".gradaccum.lock"


class RunLockError(ConfigError):
    """Another live run holds the folder (a usage error: exit 2).

    Example:
        >>> issubclass(RunLockError, ConfigError)
        True
    """


def holder(out: Path) -> dict[str, Any]:
    """What the lock file in ``out`` says about its holder (``{}`` when unreadable)."""
    try:
        info = json.loads((out / LOCK).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _describe(info: dict[str, Any]) -> str:
    if not info:
        return "another run (its lock names no holder yet)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info.get("started", 0))))
    return f"pid {info.get('pid')} on {info.get('host')}, started {started}"


def _busy(out: Path, option: str) -> RunLockError:
    return RunLockError(f"{option} {out} is in use by a running gradaccum run "
                        f"({_describe(holder(out))}); wait for it, or give another {option}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _acquire_flock(path: Path) -> int:
    """Open and flock ``path``; the fd, or -1 when another process holds it."""
    assert fcntl is not None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return -1
        # The holder may have removed the file between our open and our flock: then we hold
        # a lock on a name that no longer exists, and must lock the new file instead.
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        os.close(fd)


def _acquire_excl(path: Path) -> int:
    """Create ``path`` exclusively; take over a lock whose holder on this host is dead."""
    for _ in range(2):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            info = holder(path.parent)
            pid = info.get("pid")
            if info.get("host") != socket.gethostname() or not isinstance(pid, int) or _alive(pid):
                return -1
            path.unlink(missing_ok=True)  # a killed run's lock
    return -1


@contextlib.contextmanager
def run_lock(out: Path, option: str = "--out") -> Iterator[None]:
    """Hold ``out``'s run lock while the block runs.

    Args:
        out: the run's folder (created if missing).
        option: the option that named it, for the message.

    Raises:
        RunLockError: a live run holds it; the message names its pid, host and start time.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> with run_lock(folder):
        ...     holder(folder)["pid"] == os.getpid()
        True
        >>> (folder / LOCK).exists()
        False
    """
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    fd = _acquire_excl(path) if fcntl is None else _acquire_flock(path)
    if fd < 0:
        raise _busy(out, option)
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(info).encode())
        yield
    finally:
        path.unlink(missing_ok=True)  # before the flock goes: a waiting run then locks a new file
        os.close(fd)
