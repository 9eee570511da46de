"""How the benchmark measures: allocator peaks, the memory floor, and interleaved timings.

Allocator peak on CPU: the PyTorch profiler with ``profile_memory=True`` records one
``[memory]`` event per allocation (positive bytes) and per free (negative bytes), in order. Their
running sum is the number of bytes the allocator holds for tensors, relative to the start of
the profile; its maximum is the peak (:func:`gradaccum.torch.memory.probe.cpu_allocations`, shared
with ``gradaccum plan``). On CUDA, ``torch.cuda.max_memory_allocated`` gives the same quantity
directly. Both count tensor memory only (not the Python heap or library code).

Saved activations (:func:`saved_activations`): the bytes autograd keeps for backward, counted
through ``torch.autograd.graph.saved_tensors_hooks`` as distinct storages alive at once (a tensor
saved by two nodes, or a view of one, counts once; parameters do not count). The same number on
every device, and the part of a step's memory that grows with the batch.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from gradaccum.torch.memory.probe import cpu_allocations, tensor_bytes

__all__ = [
    "Memory",
    "Timings",
    "allocator_memory",
    "device_sync",
    "floor_bytes",
    "interleaved",
    "minor_faults",
    "saved_activations",
    "step_grads",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Memory:
    """Tensor memory used while a function ran, relative to when it started (bytes).

    Attributes:
        peak: the most held at any moment.
        end: still held when it returned (what it keeps resident).
    """

    peak: int
    end: int


def allocator_memory(fn: Callable[[], T], device: torch.device) -> tuple[T, Memory]:
    """Run ``fn`` and measure the tensor memory it allocates on ``device``.

    Args:
        fn: builds and runs what is measured; return what must stay alive (a model, an optimizer)
            so that ``Memory.end`` counts it.
        device: ``cpu`` (profiler memory events) or a CUDA device (allocator statistics).

    Returns:
        ``fn``'s result and the :class:`Memory` it used.

    Example:
        >>> _, mem = allocator_memory(lambda: torch.zeros(1024), torch.device("cpu"))
        >>> mem.end >= 4096
        True
    """
    if device.type != "cuda":
        result, peak, end = cpu_allocations(fn)
        return result, Memory(peak, end)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return result, Memory(torch.cuda.max_memory_allocated(device) - base,
                          torch.cuda.memory_allocated(device) - base)


class _Saved:
    """What autograd holds for backward: each storage's bytes and how many saved tensors use it."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.users: dict[int, int] = {}
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return t
        if key not in self.users:
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.users[key] = self.users.get(key, 0) + 1
        return _Held(self, t, key, storage.nbytes())

    def release(self, key: int, nbytes: int) -> None:
        self.users[key] -= 1
        if not self.users[key]:
            del self.users[key]
            self.now -= nbytes


class _Held:
    """A saved tensor; when autograd drops it (the graph is freed), its storage's count goes down."""

    def __init__(self, owner: _Saved, tensor: torch.Tensor, key: int, nbytes: int) -> None:
        self.owner, self.tensor, self.key, self.nbytes = owner, tensor, key, nbytes

    def __del__(self) -> None:
        self.owner.release(self.key, self.nbytes)


def _unpack(held: Any) -> torch.Tensor:
    return held.tensor if isinstance(held, _Held) else held


def saved_activations(fn: Callable[[], T], exclude: Iterable[torch.Tensor] = ()) -> tuple[T, int]:
    """Run ``fn`` and count the tensors autograd saves for backward while it runs.

    Args:
        fn: what is measured (forwards and backwards).
        exclude: tensors not to count (the parameters: they are held whatever the batch).

    Returns:
        ``fn``'s result and the most bytes of saved storages alive at any moment.

    Example:
        >>> w = torch.ones(4, requires_grad=True)
        >>> _, held = saved_activations(lambda: (w * torch.ones(1024, 4)).sum().backward(), [w])
        >>> held  # the (1024, 4) float32 input, saved for w's gradient
        16384
    """
    counter = _Saved({t.untyped_storage().data_ptr() for t in exclude})
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, _unpack):
        result = fn()
    return result, counter.peak


def device_sync(device: torch.device) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def floor_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters + one gradient per trainable parameter + the optimizer's state, in bytes.

    The least any training step must hold, whatever the batch; call it after one step, when
    the optimizer's state exists.
    """
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return (tensor_bytes(params) + tensor_bytes([p for p in params if p.requires_grad])
            + tensor_bytes(state))


def minor_faults() -> int:
    """Minor page faults of this process so far (each is a page the OS had to map in)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


@dataclass(frozen=True)
class Timings:
    """Seconds per call of each contender, one value per round (rounds interleave contenders)."""

    samples: dict[str, list[float]]

    def median(self, name: str) -> float:
        """The median seconds of one contender."""
        return statistics.median(self.samples[name])

    def ratio(self, name: str, base: str) -> float:
        """``median(name) / median(base)``."""
        return self.median(name) / self.median(base)

    def paired_quartiles(self, name: str, base: str) -> tuple[float, float]:
        """The lower and upper quartile of the per-round ratios ``name / base``."""
        ratios = [a / b for a, b in zip(self.samples[name], self.samples[base], strict=True)]
        if len(ratios) < 2:
            return ratios[0], ratios[0]
        q = statistics.quantiles(ratios, n=4, method="inclusive")
        return q[0], q[2]


def interleaved(fns: dict[str, Callable[[], None]], repeats: int, calls: int,
                sync: Callable[[], None] = lambda: None, warmup: bool = True) -> Timings:
    """Time contenders in rounds: each round runs every contender ``calls`` times, in turn.

    The order rotates from round to round (A B C, B C A, C A B...), so that no contender always
    runs first or after the same neighbour.

    Args:
        fns: name -> the function to time.
        repeats: timed rounds.
        calls: calls per contender per round; the sample is their mean.
        sync: called before reading the clock (e.g. ``torch.cuda.synchronize``).
        warmup: run one untimed round first.

    Returns:
        :class:`Timings`, seconds per call.

    Example:
        >>> t = interleaved({"a": lambda: None, "b": lambda: None}, repeats=3, calls=2)
        >>> len(t.samples["a"])
        3
    """
    names: Sequence[str] = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(-1 if warmup else 0, repeats):
        shift = max(round_, 0) % len(names)
        for name in [*names[shift:], *names[:shift]]:
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                fns[name]()
            sync()
            if round_ >= 0:
                samples[name].append((time.perf_counter() - start) / calls)
    return Timings(samples)


def step_grads(model: torch.nn.Module, step: Callable[[], Any]) -> list[torch.Tensor]:
    """The gradient each parameter of ``model`` gets from the one optimizer step ``step`` makes
    (zeros where it gets none), as the optimizer sees it; ``model``'s gradients are cleared first.

    Raises:
        RuntimeError: ``step`` made no optimizer step, or more than one.
    """
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    params = list(model.parameters())
    seen: list[list[torch.Tensor]] = []
    model.zero_grad(set_to_none=True)
    hook = register_optimizer_step_pre_hook(
        lambda *_: seen.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]))
    try:
        step()
    finally:
        hook.remove()
    if len(seen) != 1:
        raise RuntimeError(f"expected one optimizer step, got {len(seen)}")
    return seen[0]
