"""A small reader of MNIST's IDX files (gzip), checked against their known md5 sums.

The wheel carries no data: the four files are found in a folder the user names, the checkout's
``data/mnist`` (CC BY-SA 3.0, see the README beside them) or the user's cache, which
``gradaccum data mnist`` fills (:mod:`gradaccum.demos.data_dirs`).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from gradaccum.demos.data_dirs import FILES, find_mnist

if TYPE_CHECKING:
    import torch

__all__ = ["FILES", "MNIST_MEAN", "MNIST_STD", "default_data_dir", "load_mnist", "mnist_tensors",
           "read_idx"]

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def default_data_dir() -> Path:
    """The folder the demo reads when given none: the checkout's ``data/mnist``, else the user's
    cache (:func:`gradaccum.demos.data_dirs.find_mnist`).

    Raises:
        MnistNotFoundError: neither holds the four files; the message says how to get them.
    """
    return find_mnist()


# MNIST's largest file unpacks to 47,040,016 bytes: a file that unpacks to more is no MNIST file
# (a gzip bomb from a bad mirror is refused without unpacking it whole).
MAX_UNPACKED_BYTES = 64 * 2**20


def _gunzip(data: bytes) -> bytes:
    """``gzip.decompress`` of one member, refusing more than :data:`MAX_UNPACKED_BYTES`."""
    inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    raw = inflate.decompress(data, MAX_UNPACKED_BYTES + 1)
    if len(raw) > MAX_UNPACKED_BYTES:
        raise ValueError(f"unpacks to more than {MAX_UNPACKED_BYTES // 2**20} MiB: not an MNIST file")
    if not inflate.eof:
        raise EOFError("compressed file ended before the end-of-stream marker was reached")
    return raw


def read_idx(path: Path, md5: str | None = None) -> NDArray[np.uint8]:
    """Read one gzipped IDX file into a uint8 array.

    Args:
        path: the ``.gz`` file.
        md5: the expected md5 of the decompressed bytes, or ``None`` to skip the check.

    Returns:
        The array, shaped by the file's header (``[n, 28, 28]`` images, ``[n]`` labels).

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: the file is truncated, not gzip, fails its md5, or has a bad header; the
            message names the file.
    """
    if not path.is_file():
        raise FileNotFoundError(f"MNIST file {path.name} not found in {path.parent} "
                                "(use --data DIR to point at a copy)")
    try:
        raw = _gunzip(path.read_bytes())
    except (OSError, EOFError, zlib.error) as err:
        raise ValueError(f"MNIST file {path} is truncated or not gzip: {err}") from err
    if md5 is not None and hashlib.md5(raw).hexdigest() != md5:
        raise ValueError(f"MNIST file {path} is corrupt: md5 {hashlib.md5(raw).hexdigest()} "
                         f"!= expected {md5}")
    if len(raw) < 4 or raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise ValueError(f"MNIST file {path} has no IDX uint8 header")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"MNIST file {path} holds {data.size} bytes of data, header says {dims}")
    return data.reshape(dims)


def load_mnist(
    split: str = "train", data_dir: str | Path | None = None
) -> tuple[NDArray[np.uint8], NDArray[np.uint8]]:
    """Load one split as uint8 arrays.

    Args:
        split: ``"train"`` (60,000 images) or ``"test"`` (10,000).
        data_dir: a folder holding the four ``.gz`` files; default: the checkout's copy, else
            the user's cache (:func:`gradaccum.demos.data_dirs.find_mnist`).

    Returns:
        ``(images [n, 28, 28], labels [n])``.

    Raises:
        ValueError: an unknown split, or a bad file (see :func:`read_idx`).
        FileNotFoundError: a missing file; :class:`~gradaccum.demos.data_dirs.MnistNotFoundError`
            when no folder holds the files, saying how to get them.

    Example:
        >>> images, labels = load_mnist("test")
        >>> images.shape, labels[:5].tolist()
        ((10000, 28, 28), [7, 2, 1, 0, 4])
    """
    if split not in FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    folder = Path(data_dir) if data_dir is not None else find_mnist()
    (img_name, img_md5), (lbl_name, lbl_md5) = FILES[split]
    images = read_idx(folder / img_name, img_md5)
    labels = read_idx(folder / lbl_name, lbl_md5)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(f"MNIST {split} files in {folder} disagree: images {images.shape}, "
                         f"labels {labels.shape}")
    return images, labels


def mnist_tensors(split: str = "train", data_dir: str | Path | None = None,
                  limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One split as torch tensors, as the seed prepares it: /255, then (x - 0.1307) / 0.3081.

    Returns:
        ``(x float32 [n, 1, 28, 28], y int64 [n])``; the first ``limit`` items when given.
    """
    import torch

    images, labels = load_mnist(split, data_dir)
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    # In place: one float32 copy of the images at a time (188 MB for the training set).
    x = torch.from_numpy(images.astype(np.float32)).unsqueeze(1)
    x.div_(255.0).sub_(MNIST_MEAN).div_(MNIST_STD)
    return x, torch.from_numpy(labels.astype(np.int64))
