"""Shared helpers of the backward_cached tests: a two-tower model with a learnable temperature
(OpenCLIP's shape), its loss, SupCon, data, and the full-batch reference they are compared to."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.functional import cross_entropy, normalize

D_IMG, D_TXT, D_EMB = 5, 6, 4


class Towers(nn.Module):
    """Two encoders and CLIP's ``logit_scale``; ``forward`` gives ``(image, text)`` features.

    Args:
        dropout: dropout probability inside the image tower.
        batchnorm: put a BatchNorm1d inside the image tower.
        seed: the initialization's seed.
        dtype: the parameters' dtype.
    """

    def __init__(self, dropout: float = 0.0, batchnorm: bool = False, seed: int = 0,
                 dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        torch.manual_seed(seed)
        norm: nn.Module = nn.BatchNorm1d(8) if batchnorm else nn.Identity()
        self.image = nn.Sequential(nn.Linear(D_IMG, 8), norm, nn.Dropout(dropout), nn.Tanh(),
                                   nn.Linear(8, D_EMB))
        self.text = nn.Sequential(nn.Linear(D_TXT, 8), nn.Tanh(), nn.Linear(8, D_EMB))
        self.logit_scale = nn.Parameter(torch.tensor(1.2))
        self.to(dtype)

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.image(images), self.text(texts)


class Encoders(nn.Module):
    """The towers without the temperature (FSDP2 shards modules; the temperature stays outside);
    ``forward`` encodes images and any number of texts."""

    def __init__(self, towers: Towers) -> None:
        super().__init__()
        self.image, self.text = copy.deepcopy(towers.image), copy.deepcopy(towers.text)

    def forward(self, images: torch.Tensor, *texts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.image(images), *(self.text(t) for t in texts))


def sharded(towers: Towers) -> tuple[Encoders, nn.Parameter]:
    """:class:`Encoders` of ``towers`` with each tower and the root ``fully_shard``-ed (FSDP2, under
    an initialized process group), and the temperature as a parameter of its own."""
    from torch.distributed.fsdp import fully_shard

    model = Encoders(towers)
    for tower in (model.image, model.text):
        fully_shard(tower)
    fully_shard(model)
    return model, nn.Parameter(towers.logit_scale.detach().clone())


def clip_loss(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """OpenCLIP's symmetric InfoNCE: pair i's image and text are each other's positive."""
    logits = logit_scale.exp() * normalize(image, dim=1) @ normalize(text, dim=1).T
    labels = torch.arange(len(image), device=image.device)
    return (cross_entropy(logits, labels) + cross_entropy(logits.T, labels)) / 2


def supcon_loss(z: torch.Tensor, labels: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    """Supervised contrastive loss (Khosla et al. 2020): the same label's other examples are positives."""
    z = normalize(z, dim=1)
    logits = z @ z.T / temperature
    self_mask = torch.eye(len(z), dtype=torch.bool)
    logits = logits.masked_fill(self_mask, float("-inf"))
    log_prob = logits - logits.logsumexp(dim=1, keepdim=True)
    positives = (labels[:, None] == labels[None, :]) & ~self_mask
    return -(log_prob.masked_fill(~positives, 0).sum(1) / positives.sum(1).clamp(min=1)).mean()


def pairs(n: int, seed: int = 1, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` image-text pairs of random features."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D_IMG, generator=g, dtype=dtype), torch.randn(n, D_TXT, generator=g, dtype=dtype)


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def largest_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest absolute difference between two gradient (or parameter) dicts of one model."""
    assert a.keys() == b.keys()
    worst = 0.0
    for name in a:
        assert (a[name] is None) == (b[name] is None), name
        if a[name] is not None:
            worst = max(worst, float((a[name] - b[name]).detach().abs().max()))
    return worst


def full_batch_grads(model: nn.Module, batches: Sequence[Any], loss: Callable[..., torch.Tensor],
                     weights: Sequence[float] | None = None) -> dict[str, torch.Tensor | None]:
    """The reference: for each batch, one forward of its chunks with every graph alive and one
    backward of its loss (weighted, default the mean over batches). ``batches``: lists of chunks."""
    model.zero_grad(set_to_none=True)
    weights = [1 / len(batches)] * len(batches) if weights is None else weights
    for chunks, w in zip(batches, weights, strict=True):
        outs = [model(*c) for c in chunks]
        reps = [torch.cat(column) for column in zip(*outs, strict=True)]
        (loss(*reps) * w).backward()
    return grads(model)


def step_pre_grads(acc: Any, model: nn.Module) -> list[dict[str, torch.Tensor | None]]:
    """Record, at every optimizer step of ``acc``, the gradients the optimizer sees."""
    seen: list[dict[str, torch.Tensor | None]] = []
    acc.optimizer.register_step_pre_hook(lambda *_: seen.append(grads(model)))
    return seen
