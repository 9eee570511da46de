"""A run's output folder: which files belong to a run, and how they are written (atomically).

One folder holds one run. A file is first written beside its final name and then renamed over
it (``os.replace``, atomic on POSIX and Windows), so a run killed at any moment leaves either the
previous complete file or the new complete one, never half of one.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["CHECKPOINT", "FINAL_FILES", "RUN_FILES", "OutputError", "atomic_write", "clear_leftovers",
           "clear_run", "run_files_in"]

CHECKPOINT = "checkpoint.pt"
# Written once, at the end of a run.
FINAL_FILES = ("summary.json", "params.npz", "curves.png")
# Everything `gradaccum train` writes into --out.
RUN_FILES = ("metrics.jsonl", CHECKPOINT, *FINAL_FILES)


class OutputError(OSError):
    """A run's file could not be written: the disk is full, or over its quota. The command line
    reports it in one line (exit 1).

    Example:
        >>> isinstance(OutputError(errno.ENOSPC, "no space left"), OSError)
        True
    """


_FULL = (errno.ENOSPC, errno.EDQUOT)


def atomic_write(path: Path, write: Callable[[Path], object]) -> Path:
    """Write ``path`` through a temporary file beside it, then rename it into place.

    Args:
        path: the final file.
        write: writes the content to the path it is given (the temporary file).

    Returns:
        ``path``.

    Raises:
        OutputError: the disk is full (or over quota); nothing replaced ``path``.

    Example:
        >>> import tempfile
        >>> target = Path(tempfile.mkdtemp()) / "note.txt"
        >>> atomic_write(target, lambda p: p.write_text("done")).read_text()
        'done'
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name that ends like the real one (np.savez appends .npz otherwise) and starts with a
    # dot, so that a leftover after a crash never looks like a run's file.
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except OSError as err:
        if err.errno in _FULL:
            why = os.strerror(err.errno)
            raise OutputError(err.errno, f"no space left on the device to write {path} ({why}); "
                                         f"{path.name} was left as it was") from err
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return path


def run_files_in(out: Path) -> list[str]:
    """The run files (:data:`RUN_FILES`) that ``out`` holds; ``[]`` for a missing folder."""
    return [name for name in RUN_FILES if (out / name).exists()]


def clear_leftovers(out: Path, name: str) -> None:
    """Remove the temporary files of ``name`` that a killed process left in ``out`` (this
    process's own included: call it when no write of ``name`` is under way, with the folder's
    run lock held).

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / ".checkpoint.tmp123.pt").write_bytes(b"half")
        >>> clear_leftovers(folder, "checkpoint.pt"); list(folder.iterdir())
        []
    """
    stem, suffix = Path(name).stem, Path(name).suffix
    for leftover in out.glob(f".{stem}.tmp*{suffix}"):
        leftover.unlink(missing_ok=True)


def clear_run(out: Path) -> None:
    """Remove a previous run's files from ``out``, and temporary files a killed run left behind
    (other files stay)."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
        clear_leftovers(out, name)
