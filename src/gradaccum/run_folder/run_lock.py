"""One run per output folder, held while a run writes there.

The lock is an exclusive ``fcntl.flock`` on the folder itself, so removing or replacing a file in
it cannot let a second run in. ``OUT/.gradaccum.lock`` names the holder (pid, host, start time)
for the message a second run prints, and is flocked too: over NFS a folder's flock holds on one
host only, a file's on every host. The file is opened without following links, and only a
regular file of one link is used: a symlink, hard link, folder or device in its place is refused,
and nothing is written through it. The kernel releases a flock when its process ends, however it
ends, so a lock left by a killed run is free and the next run takes it over: no pid is guessed
alive or dead. Where ``fcntl`` is missing (Windows), the file is created with ``O_EXCL`` and a
holder whose pid is no longer alive on this host is taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gradaccum.run_folder.errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK", "RunLockError", "holder", "run_lock"]

LOCK = ".gradaccum.lock"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO put in the lock's place must not hang the open
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class RunLockError(ConfigError):
    """The folder's run lock cannot be taken: another live run holds it, or its lock file is not
    a regular file (a usage error: exit 2).

    Example:
        >>> issubclass(RunLockError, ConfigError)
        True
    """


def holder(out: Path) -> dict[str, Any]:
    """What the lock file in ``out`` says about its holder (``{}`` when unreadable, or not a
    regular file: a link is not followed)."""
    try:
        fd = os.open(out / LOCK, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        info = json.loads(os.read(fd, 4096))
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return info if isinstance(info, dict) else {}


def _flock_holder(out: Path) -> int | None:
    """The pid holding a flock on the folder ``out``, as Linux's ``/proc/locks`` says (``None``
    elsewhere): the live run is named even when its lock file was removed."""
    try:
        st = os.stat(out)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2154522 0 EOF"; "->" marks waiters
        fields = line.split()
        if "FLOCK" in fields and "->" not in fields and where in fields[1:]:
            pid = fields[fields.index(where) - 1]
            return int(pid) if pid.isdigit() and int(pid) > 0 else None
    return None


def _describe(out: Path) -> str:
    info = holder(out)
    if info:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info.get("started", 0))))
        return f"pid {info.get('pid')} on {info.get('host')}, started {started}"
    pid = _flock_holder(out) if fcntl is not None else None
    if pid is not None:
        return f"pid {pid} on {socket.gethostname()}; its lock file names no holder"
    return "another run (its lock names no holder yet)"


def _busy(out: Path, option: str) -> RunLockError:
    return RunLockError(f"{option} {out} is in use by a running gradaccum run "
                        f"({_describe(out)}); wait for it, or give another {option}")


def _refuse_odd(path: Path, st: os.stat_result, option: str) -> None:
    """Refuse a lock file that is not a regular file of one link: writing it would write
    through a link into another file, or into a device."""
    if stat.S_ISLNK(st.st_mode):
        what = "a symbolic link"
    elif stat.S_ISDIR(st.st_mode):
        what = "a folder"
    elif not stat.S_ISREG(st.st_mode):
        what = "not a regular file"
    elif st.st_nlink > 1:
        what = f"a file with {st.st_nlink} hard links"
    else:
        return
    raise RunLockError(f"{option} {path.parent}: its lock file {path} is {what}; nothing was "
                       f"written through it: remove it, then run again")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed or replaced)."""
    st, now = os.fstat(fd), _lstat(path)
    return now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _open_lock_file(path: Path, option: str) -> tuple[int, bool]:
    """Open (or create) the lock file as a regular file, no link followed; the fd, and whether
    it was there already (a killed run's: the folder's flock is held)."""
    before = _lstat(path)
    if before is not None:
        _refuse_odd(path, before, option)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _NONBLOCK, 0o644)
    except OSError:  # a link or a folder put there since the look (ELOOP, EISDIR)
        now = _lstat(path)
        if now is not None:
            _refuse_odd(path, now, option)
        raise
    try:
        _refuse_odd(path, os.fstat(fd), option)
    except RunLockError:
        os.close(fd)
        raise
    return fd, before is not None


def _try_flock(fd: int) -> bool:
    assert fcntl is not None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _acquire_flock(out: Path, path: Path, option: str) -> tuple[list[int], bool]:
    """Flock the folder, then the lock file; the fds (folder first) and whether a killed run's
    lock file was taken over."""
    fds = [os.open(out, os.O_RDONLY | _DIRECTORY)]
    try:
        if not _try_flock(fds[0]):
            raise _busy(out, option)
        for _ in range(3):
            fd, existed = _open_lock_file(path, option)
            if not _try_flock(fd):  # a run on another host of a shared folder
                os.close(fd)
                raise _busy(out, option)
            if _same_file(fd, path):
                fds.append(fd)
                return fds, existed
            os.close(fd)  # its holder removed it between our open and our flock: lock the new one
        raise _busy(out, option)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _acquire_excl(out: Path, path: Path, option: str) -> tuple[list[int], bool]:
    """Create ``path`` exclusively; take over a lock whose holder on this host is dead."""
    for attempt in range(2):
        before = _lstat(path)
        if before is not None:
            _refuse_odd(path, before, option)
        try:
            return [os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)], attempt > 0
        except FileExistsError:
            info = holder(out)
            pid = info.get("pid")
            if info.get("host") != socket.gethostname() or not isinstance(pid, int) or _alive(pid):
                break
            path.unlink(missing_ok=True)  # a killed run's lock
    raise _busy(out, option)


@contextlib.contextmanager
def run_lock(out: Path, option: str = "--out") -> Iterator[bool]:
    """Hold ``out``'s run lock while the block runs.

    Args:
        out: the run's folder (created if missing).
        option: the option that named it, for the message.

    Yields:
        Whether a lock file was there already: a run that was killed used the folder.

    Raises:
        RunLockError: a live run holds it (the message names its pid, host and start time), or
            the lock file is a symlink, a folder, a hard link or not a regular file.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> with run_lock(folder) as killed_run_was_here:
        ...     holder(folder)["pid"] == os.getpid(), killed_run_was_here
        (True, False)
        >>> (folder / LOCK).exists()
        False
    """
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    fds, taken_over = (_acquire_excl if fcntl is None else _acquire_flock)(out, path, option)
    fd = fds[-1]
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(info).encode())
        yield taken_over
    finally:
        # Before the flocks go; and only our own file (another host's run may have made a new one).
        if fcntl is None or _same_file(fd, path):
            path.unlink(missing_ok=True)
        for each in reversed(fds):
            os.close(each)
