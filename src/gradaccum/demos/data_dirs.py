"""Where the demo's MNIST lives: a folder the user names, the checkout, or the user's cache.

The wheel carries no data (MNIST is 11 MB, 97 % of what a wheel with it weighed). The demo looks,
in this order, in:

1. the folder the user names (``--data DIR``, or ``data_dir=`` in the API): only there;
2. the checkout's ``data/mnist``, when gradaccum runs from a source checkout (``pip install -e .``);
3. the ``data/mnist`` of the checkout the command runs in (the current folder or one above it),
   when gradaccum was installed otherwise, e.g. from the wheel built there;
4. the user's cache, :func:`mnist_cache_dir`: ``$GRADACCUM_DATA/mnist`` when ``GRADACCUM_DATA`` is
   set, else ``$XDG_CACHE_HOME/gradaccum/mnist``, else ``~/.cache/gradaccum/mnist``.
   ``gradaccum data mnist`` fills it (:mod:`gradaccum.demos.download`).

A folder counts when it holds the four ``.gz`` files; their md5 sums are checked when read
(:func:`gradaccum.demos.mnist.read_idx`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["DATA_ENV", "FILES", "MNIST_FILES", "MnistNotFoundError", "checkout_mnist_dir", "find_mnist",
           "missing_mnist_files", "mnist_cache_dir", "working_checkout_mnist_dir"]

DATA_ENV = "GRADACCUM_DATA"

# split -> ((images file, md5 of its gunzipped bytes), (labels file, md5)): data/mnist/README.md
FILES = {
    "train": (("train-images-idx3-ubyte.gz", "6bbc9ace898e44ae57da46a324031adb"),
              ("train-labels-idx1-ubyte.gz", "a25bea736e30d166cdddb491f175f624")),
    "test": (("t10k-images-idx3-ubyte.gz", "2646ac647ad5339dbf082846283269ea"),
             ("t10k-labels-idx1-ubyte.gz", "27ae3e4e09519cfbb04c329615203637")),
}
# file name -> md5, in the order the training and test sets need them
MNIST_FILES = {name: md5 for pair in FILES.values() for name, md5 in pair}


class MnistNotFoundError(FileNotFoundError):
    """No folder holds the four MNIST files; the message says how to get them, in one line."""


def mnist_cache_dir() -> Path:
    """The user's MNIST cache: where ``gradaccum data mnist`` writes and the demo looks last.

    Returns:
        ``$GRADACCUM_DATA/mnist``, else ``$XDG_CACHE_HOME/gradaccum/mnist``, else
        ``~/.cache/gradaccum/mnist`` (an empty variable counts as unset).

    Example:
        >>> mnist_cache_dir().name
        'mnist'
    """
    root = os.environ.get(DATA_ENV)
    if root:
        return Path(root).expanduser() / "mnist"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "gradaccum" / "mnist"


def checkout_mnist_dir() -> Path | None:
    """The checkout's ``data/mnist`` when gradaccum runs from a source checkout, else ``None``.

    A checkout is ``ROOT/src/gradaccum`` with ``ROOT/pyproject.toml`` beside it; an installed
    wheel (``site-packages/gradaccum``) is none.
    """
    package = Path(__file__).resolve().parents[1]
    src = package.parent
    if src.name != "src" or not (src.parent / "pyproject.toml").is_file():
        return None
    folder = src.parent / "data" / "mnist"
    return folder if folder.is_dir() else None


# The project's own pyproject.toml: what tells gradaccum's checkout from another project's.
_OUR_PROJECT = re.compile(r'^name\s*=\s*"gradaccum"\s*$', re.MULTILINE)


def working_checkout_mnist_dir(start: Path | None = None) -> Path | None:
    """The ``data/mnist`` of the gradaccum checkout that ``start`` (the current folder) is in.

    The wheel built in a checkout and installed over its editable install runs from
    site-packages, where :func:`checkout_mnist_dir` finds nothing; run in the checkout, the
    demo still reads the checkout's data. A checkout is a folder, ``start`` or one above it,
    whose ``pyproject.toml`` names the project ``gradaccum`` and that holds ``data/mnist``.

    Returns:
        That folder, or ``None``.
    """
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        project = folder / "pyproject.toml"
        if project.is_file() and (folder / "data" / "mnist").is_dir():
            try:
                if _OUR_PROJECT.search(project.read_text(errors="replace")):
                    return folder / "data" / "mnist"
            except OSError:
                pass
    return None


def missing_mnist_files(folder: Path) -> list[str]:
    """The names of the four MNIST files that ``folder`` lacks (all four if it is not a folder).

    Example:
        >>> missing_mnist_files(Path("/nonexistent"))[0]
        'train-images-idx3-ubyte.gz'
    """
    return [name for name in MNIST_FILES if not (folder / name).is_file()]


def _hint() -> str:
    return (f"no MNIST data found: run `gradaccum data mnist` (downloads 11 MB into "
            f"{mnist_cache_dir()}, md5-checked), or pass --data DIR, a folder with the four .gz files")


def find_mnist(data_dir: str | Path | None = None) -> Path:
    """The folder to read MNIST from (see the module's docstring for the order).

    Args:
        data_dir: a folder the user named; when given, the only place looked at.

    Returns:
        A folder holding the four ``.gz`` files (not yet md5-checked: reading checks).

    Raises:
        MnistNotFoundError: ``data_dir`` lacks a file (the message names it), or, without
            ``data_dir``, neither a checkout nor the cache holds the files (the message says
            how to get them).

    Example:
        >>> try:
        ...     find_mnist("/nonexistent")
        ... except MnistNotFoundError as err:
        ...     print(str(err).split(" (")[0])
        MNIST file train-images-idx3-ubyte.gz not found in /nonexistent
    """
    if data_dir is not None:
        folder = Path(data_dir)
        missing = missing_mnist_files(folder)
        if missing:
            raise MnistNotFoundError(f"MNIST file {missing[0]} not found in {folder} "
                                     f"(`gradaccum data mnist --dir {folder}` downloads the four files)")
        return folder
    # each place is looked in only when the ones before it lack the files
    for where in (checkout_mnist_dir, working_checkout_mnist_dir, mnist_cache_dir):
        candidate = where()
        if candidate is not None and not missing_mnist_files(candidate):
            return candidate
    raise MnistNotFoundError(_hint())
