"""A GPT in nanoGPT's shape, and token batches for it: the model most of the GPU checks train.

Pre-LayerNorm blocks (causal self-attention through ``scaled_dot_product_attention``, a GELU MLP
of 4x the width), learned positions, and an output head tied to the token embedding, as nanoGPT's
``model.py``. :data:`GPT_100M` (12 layers, width 768, 16,384 tokens) has about 98 M parameters;
the smaller configurations run the same code in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT", "GPT_100M", "GPT_SMALL", "GPT_TINY", "IGNORE", "GPTConfig", "gpt_loss", "token_batches"]

IGNORE = -1  # target of a padding position (cross_entropy's ignore_index, as nanoGPT)


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of a :class:`GPT`.

    Attributes:
        vocab: tokens in the vocabulary.
        block: the sequence length (positions).
        layers: transformer blocks.
        heads: attention heads per block (``width`` must divide by it).
        width: the embedding width.
    """

    vocab: int
    block: int
    layers: int
    heads: int
    width: int


GPT_100M = GPTConfig(vocab=16384, block=1024, layers=12, heads=12, width=768)
GPT_SMALL = GPTConfig(vocab=4096, block=256, layers=2, heads=4, width=256)
GPT_TINY = GPTConfig(vocab=64, block=16, layers=2, heads=2, width=32)


class _Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln_1 = nn.LayerNorm(c.width)
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.attn_out = nn.Linear(c.width, c.width)
        self.ln_2 = nn.LayerNorm(c.width)
        self.fc = nn.Linear(c.width, 4 * c.width)
        self.fc_out = nn.Linear(4 * c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, t, w))
        out: torch.Tensor = x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))
        return out


def _init_weights(module: nn.Module) -> None:
    """nanoGPT's initialization: N(0, 0.02) weights, zero biases (logits near 0 at the start)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class GPT(nn.Module):
    """A decoder-only transformer: token ids ``(batch, time)`` in, logits ``(batch, time, vocab)`` out.

    Args:
        config: its sizes.

    Example:
        >>> model = GPT(GPT_TINY)
        >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 64])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.width % config.heads:
            raise ValueError(f"width {config.width} must be a multiple of heads {config.heads}")
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.width)
        self.wpe = nn.Embedding(config.block, config.width)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.head.weight = self.wte.weight  # weight tying, as GPT-2 and nanoGPT
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the real (non-padding) positions, as nanoGPT computes it."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


def token_batches(config: GPTConfig, micro_batch: int, count: int, device: torch.device, *,
                  seed: int = 0, padded: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` micro-batches of random token ids and next-token targets, made on ``device``.

    Args:
        config: the model's sizes (vocabulary, sequence length).
        micro_batch: sequences per micro-batch.
        count: micro-batches.
        device: where the tensors live (made there once, so no copy runs inside a measurement).
        seed: the generator's seed.
        padded: end every sequence after a random length: the targets past it are padding, so
            the real tokens (the ``n_items`` of a token-weighted loss) differ per micro-batch.

    Returns:
        ``[(inputs, targets), ...]``, both ``(micro_batch, block)`` int64.

    Example:
        >>> (x, y), = token_batches(GPT_TINY, 3, 1, torch.device("cpu"), padded=True)
        >>> x.shape, bool((y == -1).any())
        (torch.Size([3, 16]), True)
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, config.vocab, (micro_batch, config.block + 1), generator=g)
        x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
        if padded:
            lengths = torch.randint(1, config.block, (micro_batch, 1), generator=g)
            y[torch.arange(config.block).expand_as(y) >= lengths] = IGNORE
        out.append((x.to(device), y.to(device)))
    return out
