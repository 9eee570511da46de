"""What every GPU check shares: the context it runs in, the outcome it returns, a few measures.

A check is a module with ``TITLE`` (its row's name), ``BUDGET_S`` (its time box, in seconds) and
``run(ctx: Context) -> Outcome``. It runs in a process of its own (``gradaccum.bench.gpu.child``)
on the device of :attr:`Context.device`: CUDA, or the CPU for the smoke (tiny sizes, the same code
path). Its raw numbers go through :meth:`Context.record`, which writes them to the result file at
once, so a check stopped by its time box still leaves what it had measured.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gradaccum.bench.measure import Memory, allocator_memory

__all__ = ["Context", "Outcome", "alloc_bytes", "peak", "rel_l2", "size_text", "to_jsonable"]

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to 512 bytes


@dataclass
class Context:
    """Where and how one check runs.

    Attributes:
        device: ``cuda`` for the real check, ``cpu`` for the smoke.
        deadline: ``time.time()`` by which the check should have returned (its time box, less a
            margin); a check that repeats measurements stops repeating when it is near.
        result: the JSON file its raw numbers and outcome are written to (None: not written).
        raw: the raw numbers recorded so far.
    """

    device: torch.device
    deadline: float
    result: Path | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def smoke(self) -> bool:
        """True without CUDA: tiny sizes, seconds, the same code path."""
        return self.device.type != "cuda"

    def time_left(self) -> float:
        """Seconds left before :attr:`deadline`."""
        return self.deadline - time.time()

    def record(self, **values: Any) -> None:
        """Add raw numbers and write them out now (they survive a time-out)."""
        self.raw.update(values)
        self.write({"status": "running"})

    def log(self, message: str) -> None:
        """A progress line (it goes to the check's log file)."""
        print(message, flush=True)

    def write(self, fields: dict[str, Any]) -> None:
        """Write ``fields`` and the raw numbers to :attr:`result`."""
        if self.result is not None:
            payload = {**fields, "raw": to_jsonable(self.raw)}
            tmp = self.result.with_suffix(".tmp")
            tmp.write_text(json.dumps(payload, indent=1))
            tmp.replace(self.result)


@dataclass(frozen=True)
class Outcome:
    """A check's row.

    Attributes:
        measured: the figures, short (they go into a table cell).
        target: what they should be, in the same words.
        met: whether they are; ``None`` where the smoke's figures say nothing about the target
            (a CPU timing of a tiny model is no GPU overhead).
    """

    measured: str
    target: str
    met: bool | None


def to_jsonable(value: Any) -> Any:
    """``value`` with tensors, tuples and non-finite floats turned into what JSON holds.

    Example:
        >>> to_jsonable({"a": (torch.tensor(1.5), float("inf"))})
        {'a': [1.5, 'inf']}
    """
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def peak(fn: Callable[[], Any], device: torch.device) -> Memory:
    """The tensor memory ``fn`` allocates on ``device``: its peak and what it keeps (bytes).

    ``torch.cuda.max_memory_allocated`` on CUDA, the profiler's memory events on the CPU
    (:func:`gradaccum.bench.measure.allocator_memory`); both relative to when ``fn`` starts.
    """
    return allocator_memory(fn, device)[1]


def alloc_bytes(tensors: Iterable[torch.Tensor], device: torch.device, itemsize: int | None = None) -> int:
    """The bytes the allocator reserves for ``tensors`` (or for same-shaped ones of ``itemsize``).

    CUDA's caching allocator rounds each allocation up to 512 bytes; the CPU's counts exact bytes.

    Example:
        >>> alloc_bytes([torch.zeros(3)], torch.device("cpu"), itemsize=8)
        24
    """
    total = 0
    for t in tensors:
        n = t.numel() * (t.element_size() if itemsize is None else itemsize)
        total += -(-n // CUDA_BLOCK) * CUDA_BLOCK if device.type == "cuda" else n
    return total


def size_text(n: float) -> str:
    """Bytes for a check's line: GiB with two decimals from 1 GiB up, else MiB with one.

    Example:
        >>> size_text(3 * 2**29), size_text(2**20)
        ('1.50 GiB', '1.0 MiB')
    """
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def rel_l2(got: Iterable[torch.Tensor], want: Iterable[torch.Tensor]) -> float:
    """``||got - want|| / ||want||`` over all the tensors together, computed in float64.

    Example:
        >>> round(rel_l2([torch.tensor([3.0, 4.5])], [torch.tensor([3.0, 4.0])]), 6)
        0.1
    """
    diff = want_sq = 0.0
    for a, b in zip(got, want, strict=True):
        a64, b64 = a.detach().double(), b.detach().double()
        diff += float((a64 - b64).square().sum())
        want_sq += float(b64.square().sum())
    return math.sqrt(diff / want_sq) if want_sq else math.sqrt(diff)
