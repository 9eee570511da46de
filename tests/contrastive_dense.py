"""The dense formulas the tiled losses of ``gradaccum.contrastive`` are compared to: each builds the
whole ``B x B`` matrix of logits, as the issue (and OpenCLIP, sentence-transformers) write them."""

from __future__ import annotations

import torch
from torch.nn.functional import cross_entropy, logsigmoid


def clip_dense(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor | float) -> torch.Tensor:
    """``(CE(s a b^T, diag) + CE(s b a^T, diag)) / 2``."""
    labels = torch.arange(len(a), device=a.device)
    return (cross_entropy(s * a @ b.T, labels) + cross_entropy(s * b @ a.T, labels)) / 2


def info_nce_dense(q: torch.Tensor, k: torch.Tensor, s: torch.Tensor | float) -> torch.Tensor:
    """``CE(s q k^T, arange(len(q)))``: key ``i`` is query ``i``'s positive, the rest negatives."""
    return cross_entropy(s * q @ k.T, torch.arange(len(q), device=q.device))


def siglip_dense(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor | float,
                 t: torch.Tensor | float) -> torch.Tensor:
    """OpenCLIP's ``SigLipLoss`` on one process: ``-sum logsigmoid(z * (s a b^T + t)) / B``."""
    z = 2 * torch.eye(len(a), dtype=a.dtype, device=a.device) - 1
    return -logsigmoid(z * (s * a @ b.T + t)).sum() / len(a)
