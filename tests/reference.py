"""Shared test helpers: small models, data, and the full-batch reference every test compares to."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

D_IN, HIDDEN, D_OUT = 6, 8, 3


def mlp(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    """A small smooth MLP (tanh: no kinks, so micro-batching cannot change a branch)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, D_OUT)).to(dtype)


def data(n: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D_IN, generator=g, dtype=dtype), torch.randint(0, D_OUT, (n,), generator=g)


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(name)


def clone_model(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def reference_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    windows: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy,
    clip_norm: float | None = None,
    scheduler: object | None = None,
) -> list[float]:
    """One plain full-batch step per window; returns the losses."""
    losses = []
    for x, y in windows:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        opt.step()
        if scheduler is not None:
            scheduler.step()  # type: ignore[attr-defined]
        losses.append(float(loss.detach()))
    return losses


def assert_params_close(a: nn.Module, b: nn.Module, dtype: torch.dtype) -> None:
    """float64: atol 1e-12; float32: torch.testing.assert_close defaults."""
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        if dtype == torch.float64:
            torch.testing.assert_close(pa, pb, atol=1e-12, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        else:
            torch.testing.assert_close(pa, pb, msg=lambda m, n=name: f"{n}: {m}")


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def bitwise_equal(model: nn.Module, saved: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(p, s) for p, s in zip(model.parameters(), saved, strict=True))


VOCAB, PAD = 11, -100  # the tiny language model's vocabulary and padding target


def tiny_lm(dtype: torch.dtype = torch.float64) -> nn.Module:
    """An embedding, tanh and a linear head over :data:`VOCAB` tokens (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB)).to(dtype)


def padded(n_seqs: int, max_len: int, seed: int,
           empty: Iterable[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets with -100 padding; the sequences in ``empty`` have no target."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n_seqs, max_len), generator=g)
    lengths = torch.randint(1, max_len + 1, (n_seqs,), generator=g)
    targets = torch.randint(0, VOCAB, (n_seqs, max_len), generator=g)
    targets[torch.arange(max_len) >= lengths[:, None]] = PAD
    for i in empty:
        targets[i] = PAD
    return tokens, targets


def lm_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
            reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the real (non-:data:`PAD`) targets."""
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(),
                                       ignore_index=PAD, reduction=reduction)
