"""Record what every module of a model does in its forward: batch inputs, outputs, RNG draws.

Used by the equivalence checker to name the modules that break accumulation: a module whose
inputs agree between the full batch and the concatenated micro-batches but whose output does
not mixes the samples of its batch (BatchNorm) or draws random numbers (dropout).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["ModuleCall", "ModuleTrace", "batch_tensors", "trace_modules"]


@dataclass
class ModuleCall:
    """One forward call of one module: its batch-shaped inputs and outputs (detached copies)."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    drew_random: bool


@dataclass
class ModuleTrace:
    """Every forward call of every module, by qualified name (``""`` is the model itself)."""

    calls: dict[str, list[ModuleCall]] = field(default_factory=dict)

    def drew_random(self, name: str) -> bool:
        """True when any call of module ``name`` changed the RNG state."""
        return any(c.drew_random for c in self.calls.get(name, []))


def batch_tensors(value: Any, batch: int) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or a tuple/list/dict of them, one level deep) whose
    first dimension is ``batch``, detached and copied (an in-place op may change them later).

    Example:
        >>> [t.shape for t in batch_tensors((torch.ones(4, 2), torch.ones(3), 5), 4)]
        [torch.Size([4, 2])]
    """
    if isinstance(value, dict):
        value = list(value.values())
    items = value if isinstance(value, (tuple, list)) else [value]
    return [t.detach().clone() for t in items
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch]


def _rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


@contextmanager
def trace_modules(model: nn.Module, batch: int, device: torch.device) -> Iterator[ModuleTrace]:
    """Record every module's forward calls while the block runs.

    Args:
        model: the model whose modules (itself included) are traced.
        batch: the batch size of the forwards: only tensors with this first dimension are kept.
        device: where the model runs; its RNG state tells whether a forward drew random numbers.

    Yields:
        The :class:`ModuleTrace`, filled as forwards run.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.5))
        >>> with trace_modules(net, 4, torch.device("cpu")) as trace:
        ...     _ = net(torch.ones(4, 3))
        >>> trace.drew_random("0"), trace.drew_random("1")
        (False, True)
    """
    trace = ModuleTrace()
    pending: dict[str, list[tuple[list[torch.Tensor], torch.Tensor]]] = {}
    handles = []
    for name, module in model.named_modules():
        def pre(_m: nn.Module, args: Any, kwargs: Any, _name: str = name) -> None:
            # Keyword arguments count as inputs too (a Hugging Face model gets nothing else).
            inputs = batch_tensors([*args, *kwargs.values()], batch)
            pending.setdefault(_name, []).append((inputs, _rng_state(device)))

        def post(_m: nn.Module, _args: Any, _kwargs: Any, output: Any, _name: str = name) -> None:
            inputs, rng = pending[_name].pop()
            drew = not torch.equal(rng, _rng_state(device))
            trace.calls.setdefault(_name, []).append(
                ModuleCall(inputs, batch_tensors(output, batch), drew))

        handles += [module.register_forward_pre_hook(pre, with_kwargs=True),
                    module.register_forward_hook(post, with_kwargs=True)]
    try:
        yield trace
    finally:
        for handle in handles:
            handle.remove()
