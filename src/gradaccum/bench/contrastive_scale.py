"""The tiled contrastive loss against the dense one as the batch grows: one ``backward_cached`` step
of a tiny two-tower model, its peak memory growth and its time.

``benchmarks/contrastive_scale.py`` runs it on the CPU, one fresh process per point; the GPU
check's ``contrastive_tiled`` row runs it on one GPU under bf16 autocast.

* :class:`TinyTowers`: two small MLPs (image and text features to ``dim``), the features
  normalized, OpenCLIP's learnable ``logit_scale`` (``ln(1 / 0.07)``): the encoders cost little,
  so the loss is what grows.
* ``dense``: OpenCLIP's loss on the whole ``B x B`` matrix (:func:`gradaccum.bench.towers.clip_loss`),
  as ``loss_fn`` of ``backward_cached`` (what 0.3.0 did); ``tiled``:
  :func:`gradaccum.contrastive.clip_loss`. Both get ``logit_scale.exp()``.
* Peak growth on the CPU: the process's peak resident set (``ru_maxrss``) after the step minus
  before it, in a fresh process warmed up on a small batch (so that the lazy set-up of torch and
  the allocator is not counted); on CUDA, ``max_memory_allocated`` above what was allocated
  before the step.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.functional import normalize

from gradaccum import Accumulator, chunks
from gradaccum.bench import towers
from gradaccum.bench.measure import allocator_memory
from gradaccum.contrastive import clip_loss

__all__ = ["METHODS", "ScaleSizes", "TinyTowers", "cached_step", "dense_estimate", "pair_features",
           "peak_growth"]

METHODS = ("dense", "tiled")


@dataclass(frozen=True)
class ScaleSizes:
    """The benchmark's model and chunks.

    Attributes:
        inputs: features per image and per text.
        width: the MLPs' hidden width.
        dim: the embedding's width ``d``.
        chunk: pairs per chunk of ``backward_cached``.
    """

    inputs: int = 32
    width: int = 64
    dim: int = 64
    chunk: int = 1024


class TinyTowers(nn.Module):
    """Two MLPs, ``model(images, texts)`` -> their normalized features (``logit_scale`` apart).

    Args:
        sizes: the widths.

    Example:
        >>> model = TinyTowers(ScaleSizes(inputs=3, width=4, dim=2))
        >>> [tuple(t.shape) for t in model(torch.randn(5, 3), torch.randn(5, 3))]
        [(5, 2), (5, 2)]
    """

    def __init__(self, sizes: ScaleSizes) -> None:
        super().__init__()

        def mlp() -> nn.Module:
            return nn.Sequential(nn.Linear(sizes.inputs, sizes.width), nn.GELU(),
                                 nn.Linear(sizes.width, sizes.dim))

        self.image, self.text = mlp(), mlp()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return normalize(self.image(images), dim=-1), normalize(self.text(texts), dim=-1)


def pair_features(pairs: int, sizes: ScaleSizes, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``pairs`` random image and text feature vectors, made on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(pairs, sizes.inputs, generator=g, device=device, dtype=dtype)  # type: ignore[return-value]
                 for _ in range(2))


def dense_estimate(pairs: int) -> int:
    """Bytes the dense loss holds at once: four ``B x B`` float32 matrices (measured: 1,041 MiB of
    growth at 8,192 pairs, 4,126 MiB at 16,384)."""
    return 4 * 4 * pairs * pairs


def cached_step(method: str, model: TinyTowers, batch: tuple[torch.Tensor, torch.Tensor], chunk: int,
                autocast: torch.dtype | None = None, tile: int | None = None,
                wrapped: nn.Module | None = None) -> Callable[[], bool]:
    """One ``backward_cached`` call over ``batch`` in chunks of ``chunk`` pairs (an SGD of lr 0:
    the model does not move), with the ``dense`` or the ``tiled`` CLIP loss.

    Args:
        wrapped: the model's DDP wrapper, which encodes and is the Accumulator's ``model=``.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    outer = model if wrapped is None else wrapped
    acc = Accumulator(torch.optim.SGD(outer.parameters(), lr=0.0), 1, model=outer)
    parts = chunks(batch, chunk)
    kind = batch[0].device.type

    def encode(part: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(kind, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            return outer(*part)  # type: ignore[no-any-return]

    def loss_fn(image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        scale = model.logit_scale.exp()
        with torch.autocast(kind, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            if method == "dense":
                return towers.clip_loss(image, text, scale)
            return clip_loss(image, text, scale, tile=tile)

    return lambda: acc.backward_cached(encode, loss_fn, parts)


def peak_growth(step: Callable[[], Any], device: torch.device) -> tuple[int, float]:
    """Run ``step`` once: its peak memory growth (bytes) and its seconds (module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        _, memory = allocator_memory(step, device)
        return memory.peak, time.perf_counter() - start
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024, seconds
