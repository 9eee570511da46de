"""Memory arithmetic: a training step's peak as a line in the micro-batch, and what fits a budget.

The peak memory of a training step at micro-batch ``m`` is modelled as

    peak(m) = max(static + overhead + activation_per_sample * m, update_peak)

where ``static`` is what lives whatever ``m`` is (parameters, buffers, gradients, optimizer
state), ``activation_per_sample`` is the slope measured by probe steps at two micro-batch sizes,
``overhead`` is the rest of the intercept (workspace, the loss, allocator rounding), and
``update_peak`` the peak of the optimizer step (its temporaries), which does not depend on ``m``
and sets the peak of small micro-batches. The
measurement lives in the framework adapters; this module only does the arithmetic, so every
backend plans the same way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from gradaccum.core.validate import check_positive_int

__all__ = ["DEFAULT_PROBES", "MemoryEstimate", "check_probe_sizes", "fit_line", "fit_probes",
           "format_bytes", "parse_bytes"]

DEFAULT_PROBES = (2, 4, 8, 16)  # micro-batch sizes of the probe windows (gradaccum plan, estimate_memory)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """Parse a memory size: ``"512MiB"``, ``"2GB"``, ``"1.5GiB"`` or a plain number of bytes.

    ``KB/MB/GB`` are decimal (10^3...), ``KiB/MiB/GiB`` binary (2^10...), as the SI and IEC say.

    Raises:
        ValueError: not a size, or under 1 byte.

    Example:
        >>> parse_bytes("2MiB"), parse_bytes("1.5kB"), parse_bytes(64)
        (2097152, 1500, 64)
    """
    # Exact arithmetic: a float would round 2**60 + 1 bytes to 2**60, past any bound checked later.
    if isinstance(text, int) and not isinstance(text, bool):
        value = Fraction(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(f"budget must be a size such as 512MiB or 2GB, got {text!r}")
        value = Fraction(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise ValueError(f"budget must be at least 1 byte, got {text!r}")
    return int(value)  # whole bytes, rounded down


def format_bytes(n: float) -> str:
    """Bytes in binary units with one decimal.

    Example:
        >>> format_bytes(4_194_304), format_bytes(1536)
        ('4.0 MiB', '1.5 KiB')
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def fit_line(m1: int, y1: float, m2: int, y2: float) -> tuple[float, float]:
    """The line through two probes ``(m1, y1)`` and ``(m2, y2)``: ``(slope, intercept)``.

    Raises:
        ValueError: the two micro-batch sizes are equal (no slope to measure).

    Example:
        >>> fit_line(2, 10.0, 4, 18.0)
        (4.0, 2.0)
    """
    a, b = check_positive_int("probe micro-batch", m1), check_positive_int("probe micro-batch", m2)
    if a == b:
        raise ValueError(f"the two probe micro-batch sizes must differ, got {m1} and {m2}")
    slope = (y2 - y1) / (b - a)
    return slope, y1 - slope * a


def check_probe_sizes(sizes: Sequence[int]) -> list[int]:
    """Probe micro-batch sizes, smallest first: at least two, each an integer >= 1, all different.

    Raises:
        TypeError, ValueError: fewer than two sizes, a size that is not an integer >= 1, or a size
            given twice.

    Example:
        >>> check_probe_sizes([8, 2, 4])
        [2, 4, 8]
    """
    checked = [check_positive_int("probe micro-batch", m) for m in sizes]
    if len(checked) < 2:
        raise ValueError(f"a line needs at least two probe micro-batch sizes, got {checked}")
    if len(set(checked)) != len(checked):
        raise ValueError(f"the probe micro-batch sizes must differ, got {checked}")
    return sorted(checked)


def fit_probes(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """The least-squares line through probes ``(micro_batch, peak)``: ``(slope, intercept)``.

    Two probes give the line through both (:func:`fit_line`). More spread the measurement: on
    CUDA a probe's peak moves by a few MiB with the convolution algorithm cuDNN picks for that
    size and with what the allocator has cached, and a slope measured between two small sizes
    multiplies that noise by every sample it is extrapolated to.

    Args:
        points: ``(micro_batch, peak_bytes)`` pairs; at least two, the sizes all different.

    Returns:
        ``(slope, intercept)``: bytes per sample and bytes at micro-batch 0.

    Raises:
        TypeError, ValueError: fewer than two probes, a size that is not an integer >= 1, or a
            size given twice.

    Example:
        >>> fit_probes([(2, 10.0), (4, 18.0)])
        (4.0, 2.0)
        >>> fit_probes([(1, 5.0), (2, 7.0), (4, 11.0)])
        (2.0, 3.0)
    """
    check_probe_sizes([m for m, _ in points])
    sizes = [m for m, _ in points]
    if len(points) == 2:
        (m1, y1), (m2, y2) = points
        return fit_line(m1, y1, m2, y2)
    n = len(points)
    mean_m = Fraction(sum(sizes), n)
    ys = [Fraction(y) for _, y in points]
    mean_y = sum(ys, Fraction(0)) / n
    spread = sum(((m - mean_m) ** 2 for m in sizes), Fraction(0))
    slope = sum(((m - mean_m) * (y - mean_y) for m, y in zip(sizes, ys, strict=True)),
                Fraction(0)) / spread
    return float(slope), float(mean_y - slope * mean_m)


@dataclass(frozen=True)
class MemoryEstimate:
    """What a training step needs, in bytes, and the peak it predicts at any micro-batch.

    Attributes:
        param_bytes: parameters and buffers.
        grad_bytes: gradients (one per trainable parameter, held across a window's micro-batches).
        optimizer_bytes: optimizer state (momentum, Adam moments, step counters).
        activation_bytes_per_sample: the peak's growth per sample of micro-batch (the slope).
        overhead_bytes: the rest of the micro-batches' peak that does not grow with their size.
        update_peak_bytes: the peak of the optimizer step, everything alive included.
        probes: the micro-batch sizes the line was fitted through (empty when built by hand).

    Example:
        >>> est = MemoryEstimate(100, 100, 200, 10.0, 50.0)
        >>> est.peak(4), est.floor
        (490, 460)
        >>> est.recommend(global_batch=64, budget=900)
        (32, 2)
    """

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes_per_sample: float
    overhead_bytes: float
    update_peak_bytes: int = 0
    probes: tuple[int, ...] = ()

    @property
    def static_bytes(self) -> int:
        """Parameters, gradients and optimizer state: held whatever the micro-batch."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def peak(self, micro_batch: int) -> int:
        """Predicted peak bytes of a training step at ``micro_batch``.

        Raises:
            TypeError, ValueError: ``micro_batch`` is not an integer >= 1.
        """
        m = check_positive_int("micro_batch", micro_batch)
        line = round(self.static_bytes + self.overhead_bytes + self.activation_bytes_per_sample * m)
        return max(line, self.update_peak_bytes)

    @property
    def floor(self) -> int:
        """The smallest budget that trains at all: the peak at micro-batch 1."""
        return self.peak(1)

    def max_micro_batch(self, budget: int) -> int:
        """The largest micro-batch whose predicted peak fits ``budget`` bytes.

        Raises:
            ValueError: ``budget`` is below :attr:`floor` (even one sample does not fit).
        """
        b = check_positive_int("budget", budget)
        if b < self.floor:
            raise ValueError(
                f"budget {format_bytes(b)} ({b} B) is below the floor {format_bytes(self.floor)} "
                f"({self.floor} B): parameters {format_bytes(self.param_bytes)} + gradients "
                f"{format_bytes(self.grad_bytes)} + optimizer state {format_bytes(self.optimizer_bytes)}"
                " + one sample's activations and overhead (or the optimizer step's own peak); "
                "no micro-batch fits"
            )
        if self.activation_bytes_per_sample <= 0:
            return 2**62  # the peak does not grow with the micro-batch: any size fits
        spare = b - self.static_bytes - self.overhead_bytes
        m = max(1, math.floor(spare / self.activation_bytes_per_sample))
        # Undo float rounding at the edge, so that peak(m) <= budget holds exactly.
        while m > 1 and self.peak(m) > b:
            m -= 1
        return m

    def recommend(self, global_batch: int, budget: int) -> tuple[int, int]:
        """The micro-batch x steps that make ``global_batch`` under ``budget`` bytes.

        The fewest steps whose micro-batch fits; the micro-batch is then spread evenly over them
        (``ceil(global_batch / steps)``; a shorter last micro-batch is weighted exactly).

        Returns:
            ``(micro_batch, steps)``.

        Raises:
            TypeError, ValueError: a non-positive ``global_batch`` or ``budget``, or a budget below
                :attr:`floor`.
        """
        g = check_positive_int("global_batch", global_batch)
        fit = min(g, self.max_micro_batch(budget))
        steps = math.ceil(g / fit)
        return math.ceil(g / steps), steps
