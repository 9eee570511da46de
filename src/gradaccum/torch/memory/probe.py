"""Measuring a training step's memory: the peaks of a window, and a plan from probe windows.

On CUDA the peak is ``torch.cuda.max_memory_allocated``. On the CPU, where torch keeps no such
counter, it is rebuilt from the profiler's memory events: the bytes alive when the window starts
(parameters, buffers, gradients, optimizer state) plus the highest running sum of the
allocations and frees recorded during it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch

from gradaccum.core import check_positive_int
from gradaccum.core.memory import DEFAULT_PROBES, MemoryEstimate, check_probe_sizes, fit_probes
from gradaccum.torch.memory.oom import is_oom_error, release_memory

__all__ = ["cpu_allocations", "estimate_memory", "measure_peak", "tensor_bytes", "window_peaks"]

LossFn = Callable[[torch.Tensor], torch.Tensor]
T = TypeVar("T")


def _square_mean(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view or a shared tensor counts once).

    Example:
        >>> t = torch.zeros(4)
        >>> tensor_bytes([t, t[:2], None])
        16
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def _live_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes([*model.parameters(), *model.buffers(), *_optimizer_tensors(optimizer),
                         *(p.grad for p in model.parameters())])


@contextmanager
def _quiet_fd2() -> Iterator[None]:
    """Silence the C++ profiler's start/stop lines, written straight to file descriptor 2."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def cpu_allocations(run: Callable[[], T]) -> tuple[T, int, int]:
    """Run ``run`` under the profiler and rebuild the CPU allocator's use from its memory events.

    Each allocation and each free is one ``[memory]`` event (plus or minus its bytes); their
    running sum is the tensor memory held, relative to when ``run`` started.

    Returns:
        ``(run's result, peak, end)``: the result (held until after the profile, so that what
        ``run`` keeps is not freed inside it), the highest running sum and the final one (bytes).

    Example:
        >>> _, peak, end = cpu_allocations(lambda: torch.zeros(256))
        >>> peak >= end >= 1024
        True
    """
    from torch._C._autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with _quiet_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    events = [e for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
              if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    now = high = 0
    for event in events:
        now += event.nbytes()
        high = max(high, now)
    return result, high, now


def _cpu_peak(run: Callable[[], None], live: int) -> int:
    return live + cpu_allocations(run)[1]


def _cuda_peak(run: Callable[[], None], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def window_peaks(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 sample_shape: Sequence[int], micro_batch: int, *, steps: int = 2,
                 loss_fn: LossFn | None = None) -> tuple[int, int]:
    """Peak bytes of one training window, in its two phases: the micro-batches, then the update.

    ``steps`` micro-batches of random samples each run forward and backward into ``.grad`` (from
    the second one on, the gradients are held beside the activations, as in any accumulation;
    the Accumulator adds no buffer of its own); then the optimizer steps and the gradients are
    set to None. The update's peak (optimizer temporaries) does not depend on the micro-batch.

    Args:
        model: the model (on its device, in its dtype); it is trained by this call.
        optimizer: its optimizer; steps once.
        sample_shape: the shape of one input sample, e.g. ``(3, 64, 64)``.
        micro_batch: samples per micro-batch.
        steps: micro-batches in the window.
        loss_fn: ``loss_fn(output) -> loss``; default: the mean of the squared outputs.

    Returns:
        ``(micro_batch_peak, update_peak)``: bytes allocated on the model's device at the highest
        point of each phase, everything alive included.

    Raises:
        TypeError, ValueError: ``micro_batch`` or ``steps`` is not an integer >= 1, or the model
            has no parameters.
    """
    m = check_positive_int("micro_batch", micro_batch)
    n = check_positive_int("steps", steps)
    param = next(model.parameters(), None)
    if param is None:
        raise ValueError("model has no parameters: there is nothing to train")
    criterion = loss_fn or _square_mean

    def micro_batches() -> None:
        for _ in range(n):
            x = torch.randn(m, *sample_shape, device=param.device, dtype=param.dtype)
            torch.autograd.backward(criterion(model(x)) / n)

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if param.device.type == "cuda":
        return _cuda_peak(micro_batches, param.device), _cuda_peak(update, param.device)
    first = _cpu_peak(micro_batches, _live_bytes(model, optimizer))
    return first, _cpu_peak(update, _live_bytes(model, optimizer))


def measure_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 sample_shape: Sequence[int], micro_batch: int, *, steps: int = 2,
                 loss_fn: LossFn | None = None) -> int:
    """Peak bytes of one training window (see :func:`window_peaks`): the higher of its phases.

    Example:
        >>> model = torch.nn.Linear(64, 8)
        >>> peak = measure_peak(model, torch.optim.SGD(model.parameters(), lr=0.1), (64,), 4)
        >>> peak > 2 * 64 * 8 * 4  # parameters and gradients at least
        True
    """
    return max(window_peaks(model, optimizer, sample_shape, micro_batch, steps=steps, loss_fn=loss_fn))


def _probe_windows(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   sample_shape: Sequence[int], sizes: list[int],
                   loss_fn: LossFn | None) -> list[tuple[int, int, int]]:
    """``(size, micro-batch peak, update peak)`` at each size, smallest first, until one runs out
    of memory (after two have been measured; an earlier OOM is raised)."""
    measured: list[tuple[int, int, int]] = []
    for m in sizes:
        try:
            measured.append((m, *window_peaks(model, optimizer, sample_shape, m, loss_fn=loss_fn)))
            continue
        except Exception as error:
            if len(measured) < 2 or not is_oom_error(error):
                raise
        # Out of the except clause: its traceback (and the activations it holds) is gone.
        optimizer.zero_grad(set_to_none=True)  # the window that ran out left partial gradients
        release_memory()
        break
    return measured


def estimate_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    sample_shape: Sequence[int], probes: Sequence[int] = DEFAULT_PROBES, *,
                    loss_fn: LossFn | None = None) -> MemoryEstimate:
    """Estimate a training step's memory from probe windows at several micro-batch sizes.

    One warm-up window at the smallest size creates the optimizer state; then a window of 2
    micro-batches at each probe size, smallest first, gives a peak of the micro-batch phase, and
    the least-squares line through them (:func:`~gradaccum.core.memory.fit_probes`) the bytes per
    sample; the update's peak is the highest of the probes'. A probe that runs out of memory
    ends the probing once two sizes have been measured: the line goes through those, and
    :attr:`~gradaccum.MemoryEstimate.probes` names them.

    Args:
        model: the model (on its device, in its dtype); the probes train it: pass a fresh one.
        optimizer: its optimizer.
        sample_shape: the shape of one input sample.
        probes: two or more different micro-batch sizes (default ``(2, 4, 8, 16)``: on CUDA,
            where a probe's peak moves by a few MiB with cuDNN's choice of algorithm, four sizes
            predicted the benchmark CNN at 256 within 3%, two small ones 6 to 12% off).
        loss_fn: ``loss_fn(output) -> loss``; default: the mean of the squared outputs.

    Returns:
        A :class:`~gradaccum.MemoryEstimate`; its ``peak(m)`` predicts any micro-batch.

    Raises:
        TypeError, ValueError: fewer than two probe sizes, a size that is not an integer >= 1, or
            a size given twice.
        torch.OutOfMemoryError: one of the two smallest probes ran out of memory.

    Example:
        >>> model = torch.nn.Linear(64, 8)
        >>> est = estimate_memory(model, torch.optim.Adam(model.parameters()), (64,))
        >>> est.param_bytes, est.optimizer_bytes, est.probes
        (2080, 4168, (2, 4, 8, 16))
    """
    if isinstance(probes, (str, bytes)) or not isinstance(probes, Sequence):
        raise TypeError(f"probes must be a sequence of micro-batch sizes, got {probes!r}")
    sizes = check_probe_sizes(probes)  # before any work
    window_peaks(model, optimizer, sample_shape, sizes[0], loss_fn=loss_fn)
    measured = _probe_windows(model, optimizer, sample_shape, sizes, loss_fn)
    slope, intercept = fit_probes([(m, peak) for m, peak, _ in measured])
    params = tensor_bytes([*model.parameters(), *model.buffers()])
    grads = tensor_bytes(p for p in model.parameters() if p.requires_grad)
    state = tensor_bytes(_optimizer_tensors(optimizer))
    return MemoryEstimate(param_bytes=params, grad_bytes=grads, optimizer_bytes=state,
                          activation_bytes_per_sample=slope,
                          overhead_bytes=intercept - (params + grads + state),
                          update_peak_bytes=max(update for _, _, update in measured),
                          probes=tuple(m for m, _, _ in measured))
