"""``gradaccum data mnist``: download the demo's data into the user's cache, md5-checked.

The wheel carries no data. ``train``, ``compare`` and ``bench`` read MNIST from ``--data DIR``,
the checkout's ``data/mnist`` or the cache this command fills (see
:mod:`gradaccum.demos.data_dirs`). Exit codes: 0 the four files are there (downloaded or already
present), 1 a file no mirror gave a good copy of (nothing left behind; the line names each
mirror's failure and ``--data DIR``, the way without internet), 2 bad usage (a folder that
cannot be written).
"""

from __future__ import annotations

import argparse

from gradaccum.cli._errors import CommandError, UsageError
from gradaccum.cli._options import out_dir

__all__ = ["add_parser"]


def _run(args: argparse.Namespace) -> int:
    from gradaccum.demos.data_dirs import MNIST_FILES, mnist_cache_dir
    from gradaccum.demos.download import MIRRORS, DownloadError, download_mnist

    dest = args.dir if args.dir is not None else mnist_cache_dir()
    option = "--dir" if args.dir is not None else "the cache"
    try:
        fetched = download_mnist(dest, args.mirror or MIRRORS)
    except DownloadError as err:
        raise CommandError(f"{err}; nothing was written to {dest}. Without internet, copy the four "
                           "files (a checkout's data/mnist holds them) into a folder DIR and pass "
                           "--data DIR to train, compare and bench") from None
    except OSError as err:
        raise UsageError(f"{option} {dest} is not a writable folder ({err.strerror or err})") from None
    where = ("gradaccum train, compare and bench find it there" if args.dir is None
             else f"use it with --data {dest}")
    done = "downloaded" if fetched else "already there"
    print(f"MNIST in {dest}: {len(MNIST_FILES)} files, md5-checked ({done}); {where}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``data``."""
    p = sub.add_parser(
        "data", help="download the demo's data (MNIST, 11 MB) into the user's cache",
        description="Download the four MNIST .gz files, each checked against its md5 before it is "
                    "kept, into the user's cache ($GRADACCUM_DATA/mnist, else "
                    "$XDG_CACHE_HOME/gradaccum/mnist, else ~/.cache/gradaccum/mnist), where "
                    "train, compare and bench find them. Files already there and good are kept.")
    p.add_argument("dataset", choices=["mnist"], help="the data set (the demo's: mnist)")
    p.add_argument("--dir", type=out_dir, default=None, metavar="DIR",
                   help="download into DIR instead (then pass --data DIR to the commands)")
    p.add_argument("--mirror", action="append", default=None, metavar="URL",
                   help="a base URL to download from instead of the canonical mirrors (repeat to "
                        "try several in order); the file names are appended")
    p.set_defaults(func=_run)
