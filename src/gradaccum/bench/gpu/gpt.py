"""The sizes of the GPT most GPU checks train, its loss, and token batches for it.

The model is the demos' nanoGPT-style :class:`~gradaccum.demos.gpt.GPT` (``model(idx)`` returns
``(logits, None)``). :data:`GPT_100M` (12 layers, width 768, 16,384 tokens) has about 98 M
parameters; the smaller configurations run the same code in seconds.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gradaccum.demos.gpt import GPTConfig

__all__ = ["GPT_100M", "GPT_SMALL", "GPT_TINY", "IGNORE", "gpt_loss", "token_batches"]

IGNORE = GPTConfig.ignore_index  # target of a padding position (-1, as nanoGPT)


GPT_100M = GPTConfig(vocab_size=16384, block_size=1024, n_layer=12, n_head=12, n_embd=768)
GPT_SMALL = GPTConfig(vocab_size=4096, block_size=256, n_layer=2, n_head=4, n_embd=256)
GPT_TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the real (non-padding) positions, as nanoGPT computes it."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


def token_batches(config: GPTConfig, micro_batch: int, count: int, device: torch.device, *,
                  seed: int = 0, padded: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` micro-batches of random token ids and next-token targets, made on ``device``.

    Args:
        config: the model's sizes (``vocab_size``, ``block_size``).
        micro_batch: sequences per micro-batch.
        count: micro-batches.
        device: where the tensors live (made there once, so no copy runs inside a measurement).
        seed: the generator's seed.
        padded: end every sequence after a random length: the targets past it are padding, so
            the real tokens (the ``n_items`` of a token-weighted loss) differ per micro-batch.

    Returns:
        ``[(inputs, targets), ...]``, both ``(micro_batch, block_size)`` int64.

    Example:
        >>> (x, y), = token_batches(GPT_TINY, 3, 1, torch.device("cpu"), padded=True)
        >>> x.shape, bool((y == -1).any())
        (torch.Size([3, 16]), True)
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, config.vocab_size, (micro_batch, config.block_size + 1), generator=g)
        x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
        if padded:
            lengths = torch.randint(1, config.block_size, (micro_batch, 1), generator=g)
            y[torch.arange(config.block_size).expand_as(y) >= lengths] = IGNORE
        out.append((x.to(device), y.to(device)))
    return out
