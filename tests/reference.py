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
