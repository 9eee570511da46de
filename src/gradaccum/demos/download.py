"""Download the four MNIST files into a folder, each checked against its md5 before it lands.

The wheel carries no data; ``gradaccum data mnist`` calls :func:`download_mnist` to fill the
user's cache (:func:`gradaccum.demos.data_dirs.mnist_cache_dir`). Each file is fetched from the
first mirror that gives a good copy (:data:`MIRRORS`: the one torchvision uses, then Yann LeCun's
page) into a temporary folder beside the destination, and checked as the demo reads it: gzip,
the md5 of its bytes after gunzip (``data/mnist/README.md``), the IDX header. Only when all the
missing files are good do they move into place, each with an atomic rename: a failed download
leaves nothing behind, and a folder never holds a file that failed its check.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import tempfile
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from gradaccum.demos.data_dirs import MNIST_FILES
from gradaccum.demos.mnist import read_idx

__all__ = ["MAX_FILE_BYTES", "MIRRORS", "DownloadError", "download_mnist", "valid_mnist_file"]

# Where torchvision downloads MNIST from, in its order: its own S3 copy, then the original page.
MIRRORS = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/")
# The largest file is 9.9 MB; a mirror that sends more is not sending MNIST.
MAX_FILE_BYTES = 64 * 2**20


class DownloadError(RuntimeError):
    """No mirror gave a good copy of a file; the message names the file and each mirror's failure."""


def valid_mnist_file(path: Path) -> bool:
    """Is ``path`` one of the four MNIST files, complete and passing its md5?

    Example:
        >>> valid_mnist_file(Path("/nonexistent/t10k-labels-idx1-ubyte.gz"))
        False
    """
    try:
        read_idx(path, MNIST_FILES[path.name])
    except (OSError, ValueError, KeyError):
        return False
    return True


def _fetch(url: str, path: Path, timeout: float) -> int:
    """Write what ``url`` sends into ``path``; returns its size in bytes."""
    size = 0
    with urllib.request.urlopen(url, timeout=timeout) as response, path.open("wb") as out:
        while chunk := response.read(1 << 20):
            size += len(chunk)
            if size > MAX_FILE_BYTES:
                raise ValueError(f"sent more than {MAX_FILE_BYTES // 2**20} MiB: not an MNIST file")
            out.write(chunk)
    return size


def _fetch_checked(name: str, mirrors: Sequence[str], path: Path, timeout: float,
                   log: Callable[[str], None]) -> None:
    """Fetch ``name`` into ``path`` from the first mirror whose copy passes its checks.

    Raises:
        DownloadError: every mirror failed (unreachable, an HTTP error, a bad file).
    """
    failures = []
    for mirror in mirrors:
        url = f"{mirror.rstrip('/')}/{name}"
        try:
            size = _fetch(url, path, timeout)
            read_idx(path, MNIST_FILES[name])
        except (OSError, ValueError, http.client.HTTPException) as err:
            path.unlink(missing_ok=True)
            reason = str(err).replace(str(path), name).splitlines()[0] if str(err) else type(err).__name__
            failures.append(f"{url}: {reason}")
            continue
        amount = f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size / 1e3:.1f} kB"
        log(f"{name}: {amount} from {url}, md5 ok")
        return
    raise DownloadError(f"{name}: no mirror gave a good copy ({'; '.join(failures)})")


def _make_folder(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; returns the ones created, outermost first."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()][::-1]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def download_mnist(dest: Path, mirrors: Sequence[str] = MIRRORS, *, timeout: float = 60.0,
                   log: Callable[[str], None] = print) -> list[str]:
    """Put the four MNIST files into ``dest``, downloading those it lacks or holds damaged.

    Args:
        dest: the folder (created when needed).
        mirrors: base URLs, tried in order for each file (a file's URL is the base, then its name).
        timeout: seconds to wait on a silent connection.
        log: one line per downloaded file.

    Returns:
        The names of the files downloaded: empty when ``dest`` already held four good ones.

    Raises:
        ValueError: no mirror given.
        DownloadError: a file no mirror gave a good copy of; nothing was changed in ``dest``, and
            folders created for it are removed again.
        OSError: ``dest`` or its temporary folder cannot be created or written.

    Example:
        >>> download_mnist(Path("~/.cache/gradaccum/mnist").expanduser())  # doctest: +SKIP
        ['train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz', ...]
    """
    if not mirrors:
        raise ValueError("mirrors: give at least one base URL")
    needed = [name for name in MNIST_FILES if not valid_mnist_file(dest / name)]
    if not needed:
        return []
    created = _make_folder(dest)
    try:
        scratch = Path(tempfile.mkdtemp(prefix=".download-", dir=dest))
        try:
            for name in needed:
                _fetch_checked(name, mirrors, scratch / name, timeout, log)
            for name in needed:
                os.replace(scratch / name, dest / name)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    except BaseException:
        for folder in reversed(created):  # innermost first; a folder that holds something stays
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return needed
