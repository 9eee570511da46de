"""Section d: the seed's accumulator (two parameter-sized buffers) against gradaccum (none)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gradaccum.bench.config import Sizes, micro_batches
from gradaccum.bench.loops import window_memory
from gradaccum.bench.measure import Memory
from gradaccum.torch.memory.probe import tensor_bytes

__all__ = ["ResidentRow", "run_resident"]


@dataclass(frozen=True)
class ResidentRow:
    """One model: its parameter bytes and each loop's memory (:func:`~gradaccum.bench.loops.window_memory`).

    ``computed`` is what the seed's two buffers must take: twice the trainable parameters' bytes.
    """

    model: str
    micro_batch: int
    steps: int
    param_bytes: int
    seed: Memory
    gradaccum: Memory

    @property
    def computed(self) -> int:
        """The seed's extra resident bytes on paper: ``inner_grads`` and ``zeros``."""
        return 2 * self.param_bytes

    @property
    def resident_extra(self) -> int:
        """Measured: bytes the seed keeps after a window, minus gradaccum's."""
        return self.seed.end - self.gradaccum.end

    @property
    def peak_extra(self) -> int:
        """Measured: the seed's allocator peak minus gradaccum's."""
        return self.seed.peak - self.gradaccum.peak


def run_resident(sizes: Sizes, device: torch.device, data_dir: Path | None = None) -> list[ResidentRow]:
    """Measure both loops on each model of ``sizes.seed_models``, N = ``sizes.steps`` (``data_dir``:
    where MNIST is, for the MLP)."""
    rows = []
    for model in sizes.seed_models:
        batches = micro_batches(model, sizes.seed_micro_batch, sizes.steps, device, data_dir=data_dir)
        loop, seed = window_memory("seed", model, batches, device)
        _, ours = window_memory("gradaccum", model, batches, device)
        params = tensor_bytes([p for p in loop.model.parameters() if p.requires_grad])
        rows.append(ResidentRow(model, sizes.seed_micro_batch, sizes.steps, params, seed, ours))
    return rows
