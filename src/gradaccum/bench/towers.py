"""A CLIP-shaped two-tower model, OpenCLIP's loss, and the three ways to get a contrastive batch's
gradient that ``benchmarks/contrastive.py`` and the GPU check compare.

:class:`TwoTowers` has OpenCLIP's interface: ``model(images, texts)`` returns the normalized image
features, the normalized text features and ``logit_scale`` (the exponential of a learnable
parameter). Each tower is a pre-norm transformer over a sequence (image patches or text tokens),
mean-pooled and projected; :data:`CLIP_B32` has ViT-B/32's and CLIP's text tower's sizes
(about 150 M parameters), :data:`TOWERS_TINY` runs the same code in milliseconds.

The contenders (:func:`contenders`), each one optimizer step of the batch, with the same SGD:

* ``full batch``: one forward and backward of the whole batch (the reference);
* ``naive``: the loss of each chunk, accumulated (``acc.backward``): another objective, with
  fewer negatives, its error reported beside the others;
* ``backward_cached``: :meth:`gradaccum.Accumulator.backward_cached` over the chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.functional import cross_entropy, normalize

from gradaccum import Accumulator, chunks

__all__ = ["CLIP_B32", "TOWERS_BENCH", "TOWERS_TINY", "TowerSizes", "TwoTowers", "clip_loss",
           "contenders", "pair_batch"]


@dataclass(frozen=True)
class TowerSizes:
    """The sizes of both towers.

    Attributes:
        patches, patch_dim: image tokens per example and features per token.
        vision_width, vision_layers: the image tower's width and depth (heads of 64 features).
        tokens, vocab: text tokens per example and the vocabulary.
        text_width, text_layers: the text tower's width and depth.
        embed: the shared embedding's width.
    """

    patches: int
    patch_dim: int
    vision_width: int
    vision_layers: int
    tokens: int
    vocab: int
    text_width: int
    text_layers: int
    embed: int


# ViT-B/32 (7 x 7 patches of 32 x 32 x 3, and a class token's place) and CLIP's text tower.
CLIP_B32 = TowerSizes(patches=50, patch_dim=3072, vision_width=768, vision_layers=12, tokens=77,
                      vocab=49408, text_width=512, text_layers=12, embed=512)
TOWERS_BENCH = TowerSizes(patches=16, patch_dim=192, vision_width=128, vision_layers=2, tokens=16,
                          vocab=1000, text_width=128, text_layers=2, embed=64)
TOWERS_TINY = TowerSizes(patches=4, patch_dim=12, vision_width=16, vision_layers=1, tokens=5, vocab=50,
                         text_width=16, text_layers=1, embed=8)


class _Tower(nn.Module):
    def __init__(self, embed: nn.Module, tokens: int, width: int, layers: int, out: int) -> None:
        super().__init__()
        self.embed = embed
        self.position = nn.Parameter(torch.randn(tokens, width) * 0.02)
        block = nn.TransformerEncoderLayer(width, max(1, width // 64), 4 * width, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embed(x) + self.position)
        out: torch.Tensor = self.proj(self.norm(h.mean(dim=1)))
        return out


class TwoTowers(nn.Module):
    """Image and text towers with CLIP's learnable temperature, in OpenCLIP's shape.

    Args:
        sizes: the towers' sizes.

    Example:
        >>> model = TwoTowers(TOWERS_TINY)
        >>> images, texts = pair_batch(TOWERS_TINY, 3)
        >>> [tuple(t.shape) for t in model(images, texts)]
        [(3, 8), (3, 8), ()]
    """

    def __init__(self, sizes: TowerSizes) -> None:
        super().__init__()
        s = sizes
        self.visual = _Tower(nn.Linear(s.patch_dim, s.vision_width), s.patches, s.vision_width,
                             s.vision_layers, s.embed)
        self.text = _Tower(nn.Embedding(s.vocab, s.text_width), s.tokens, s.text_width, s.text_layers,
                           s.embed)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: torch.Tensor, texts: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (normalize(self.visual(images), dim=-1), normalize(self.text(texts), dim=-1),
                self.logit_scale.exp())


def clip_loss(image_features: torch.Tensor, text_features: torch.Tensor,
              logit_scale: torch.Tensor) -> torch.Tensor:
    """OpenCLIP's ``ClipLoss`` on one process: the symmetric cross-entropy of ``logit_scale *
    image_features @ text_features.T``, pair ``i``'s image and text each other's positive."""
    logits = logit_scale * image_features @ text_features.T
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # the softmax in float32, as under autocast
    labels = torch.arange(len(logits), device=logits.device)
    return (cross_entropy(logits, labels) + cross_entropy(logits.T, labels)) / 2


def pair_batch(sizes: TowerSizes, n: int, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` image-text pairs of random patches and token ids, made on ``device``."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, sizes.patches, sizes.patch_dim, generator=g, dtype=dtype)
    texts = torch.randint(0, sizes.vocab, (n, sizes.tokens), generator=g)
    return images.to(device), texts.to(device)


def contenders(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], pieces: int, *,
               lr: float = 0.0, autocast: torch.dtype | None = None) -> dict[str, Callable[[], None]]:
    """The three ways to take one optimizer step of ``batch`` split into ``pieces`` chunks.

    Each uses ``model`` itself (pass copies to compare gradients) and an SGD of ``lr`` (0: the
    model does not move, so the contenders can be timed in turns on one model).

    Args:
        autocast: run the forwards under ``torch.autocast`` of this dtype (None: no autocast).
    """
    size = -(-len(batch[0]) // pieces)
    parts = chunks(batch, size)
    device_type = batch[0].device.type

    def forward(images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if autocast is None:
            return tuple(model(images, texts))
        with torch.autocast(device_type, dtype=autocast):
            return tuple(model(images, texts))

    def accumulator(steps: int) -> Accumulator:
        return Accumulator(torch.optim.SGD(model.parameters(), lr=lr), steps, model=model)

    full, naive, cached = accumulator(1), accumulator(len(parts)), accumulator(1)

    def encode(chunk: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return forward(*chunk)[:2]  # logit_scale is one per batch: the loss reads it

    def loss_fn(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
        return clip_loss(image_features, text_features, model.get_parameter("logit_scale").exp())

    def run_full() -> None:
        full.backward(clip_loss(*forward(*batch)))

    def run_naive() -> None:
        for chunk in parts:
            naive.backward(clip_loss(*forward(*chunk)))

    def run_cached() -> None:
        cached.backward_cached(encode, loss_fn, parts)

    return {"full batch": run_full, "naive": run_naive, "backward_cached": run_cached}
