"""``gradaccum info``: the machine and versions, as every benchmark table states them."""

from __future__ import annotations

import argparse

from gradaccum.bench.machine import describe_machine

__all__ = ["add_parser", "describe_machine"]


def _run(args: argparse.Namespace) -> int:
    for key, value in describe_machine().items():
        print(f"{key:>14}: {value}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``info``."""
    p = sub.add_parser("info", help="print versions, threads and devices")
    p.set_defaults(func=_run)
