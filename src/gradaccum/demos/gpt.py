"""A tiny nanoGPT-style causal language model, for the language-model recipes and benchmark.

The layout follows nanoGPT's ``model.py`` (token and position embeddings, pre-norm blocks of
causal self-attention and a GELU MLP, a head tied to the token embedding), small enough to train
on a CPU in seconds. ``forward(idx, targets)`` returns ``(logits, loss)`` as nanoGPT's does, the
loss being the mean cross-entropy over the targets that are not ``ignore_index`` (nanoGPT: -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """The model's sizes; the defaults make a byte-level model of 120,576 parameters.

    Attributes:
        vocab_size: number of token ids (256: bytes).
        block_size: the longest sequence (position embeddings).
        n_layer, n_head, n_embd: depth, attention heads, width (``n_embd % n_head == 0``).
        ignore_index: the target that marks padding in ``forward``'s loss (nanoGPT: -1).
    """

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    ignore_index: int = -1


class _SelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} is not a multiple of n_head={config.n_head}")
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return out


class _Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(config.n_embd), nn.LayerNorm(config.n_embd)
        self.attn = _SelfAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    """nanoGPT's GPT in miniature: ``model(idx, targets) -> (logits, loss)``.

    Args:
        config: the sizes (:class:`GPTConfig`).

    Example:
        >>> torch.manual_seed(0) and None
        >>> model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
        >>> idx = torch.randint(0, 16, (2, 8))
        >>> targets = torch.cat([idx[:, 1:], torch.full((2, 1), -1)], dim=1)  # next token; -1 pads
        >>> logits, loss = model(idx, targets)
        >>> tuple(logits.shape), loss.dim()
        ((2, 8, 16), 0)
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT and GPT-2 do
        for name, module in self.named_modules():  # nanoGPT's init: N(0, 0.02), zero biases,
            if isinstance(module, (nn.Linear, nn.Embedding)):  # residual projections by depth
                depth = (2 * config.n_layer) ** 0.5 if name.endswith("c_proj") else 1.0
                nn.init.normal_(module.weight, std=0.02 / depth)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[batch, seq, vocab]`` and the mean loss over non-ignored targets (or None)."""
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.config.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=self.config.ignore_index)
        return logits, loss
