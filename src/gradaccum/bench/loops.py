"""The training loops the benchmark compares, each running one window of N micro-batches.

* ``hand-written``: nanoGPT's micro-step loop: ``loss / N``, backward, then step and
  ``zero_grad(set_to_none=True)``.
* ``gradaccum``: :class:`gradaccum.Accumulator`.
* ``accelerate``: Hugging Face Accelerate as its guide shows it: ``Accelerator(
  gradient_accumulation_steps=N)``, ``prepare``, and per micro-batch ``with accumulate(model)``,
  ``accelerator.backward(loss)``, ``optimizer.step()``, ``optimizer.zero_grad()``.
* ``seed``: the seed tutorial's accumulator (:class:`~gradaccum.bench.seed.SeedAccumulator`).

All train the same model from the same weights with AdamW on a cross-entropy loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradaccum.bench.measure import Memory, allocator_memory
from gradaccum.bench.seed import SeedAccumulator
from gradaccum.demos.models import build_model
from gradaccum.torch import Accumulator

__all__ = ["LOOPS", "Batches", "Loop", "accelerate_available", "build_loop", "window_memory"]

Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]

LOOPS = ("hand-written", "gradaccum", "accelerate", "seed")


@dataclass
class Loop:
    """One contender, ready to train: ``window(batches)`` runs one window (one optimizer step).

    Attributes:
        name: one of :data:`LOOPS`.
        window: feeds the N micro-batches it is given, then the optimizer has stepped once.
        model: the model it trains (kept so that its memory stays alive while it is measured).
        optimizer: its optimizer.
    """

    name: str
    window: Callable[[Batches], None]
    model: nn.Module
    optimizer: torch.optim.Optimizer


def accelerate_available() -> bool:
    """True when Hugging Face Accelerate can be imported."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def _hand_written(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> Callable[[Batches], None]:
    def window(batches: Batches) -> None:
        for x, y in batches:
            loss = nn.functional.cross_entropy(model(x), y) / steps
            torch.autograd.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return window


def _gradaccum(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> Callable[[Batches], None]:
    acc = Accumulator(opt, steps, model=model)

    def window(batches: Batches) -> None:
        for x, y in batches:
            acc.backward(nn.functional.cross_entropy(model(x), y))

    return window


def _seed(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> Callable[[Batches], None]:
    acc = SeedAccumulator([p for p in model.parameters() if p.requires_grad], opt, steps)

    def window(batches: Batches) -> None:
        for x, y in batches:
            acc.backward(nn.functional.cross_entropy(model(x), y))

    return window


def _accelerate(model: nn.Module, opt: torch.optim.Optimizer, steps: int,
                device: torch.device) -> tuple[Callable[[Batches], None], nn.Module, Any]:
    from accelerate import Accelerator

    threads = torch.get_num_threads()
    accelerator = Accelerator(gradient_accumulation_steps=steps, cpu=device.type == "cpu")
    torch.set_num_threads(threads)  # every contender runs with the same thread count
    model, opt = accelerator.prepare(model, opt)

    def window(batches: Batches) -> None:
        for x, y in batches:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()

    return window, model, opt


def build_loop(name: str, model_name: str, steps: int, device: torch.device, seed: int = 0) -> Loop:
    """Build a model (same weights for the same seed), its AdamW optimizer and one contender's loop.

    Args:
        name: one of :data:`LOOPS`.
        model_name: a demo model (:func:`gradaccum.demos.models.build_model`).
        steps: micro-batches per window (N).
        device: where it trains.
        seed: the weights' seed.

    Raises:
        ValueError: an unknown loop name.

    Example:
        >>> loop = build_loop("gradaccum", "mlp", 2, torch.device("cpu"))
        >>> from gradaccum.bench.config import micro_batches
        >>> loop.window(micro_batches("mlp", 4, 2, torch.device("cpu")))
    """
    if name not in LOOPS:
        raise ValueError(f"name must be one of {LOOPS}, got {name!r}")
    model = build_model(model_name, seed=seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if name == "accelerate":
        window, model, opt = _accelerate(model, opt, steps, device)
    else:
        factory = {"hand-written": _hand_written, "gradaccum": _gradaccum, "seed": _seed}[name]
        window = factory(model, opt, steps)
    return Loop(name, window, model, opt)


def window_memory(name: str, model_name: str, batches: Batches, device: torch.device) -> tuple[Loop, Memory]:
    """The allocator memory of building a contender and training one window of ``batches``.

    Inside the measurement, a window of one-item micro-batches runs first: it allocates the
    optimizer's state for little time, so the measured window holds everything a training step
    holds (parameters, gradients, optimizer state, activations).

    Returns:
        The contender (alive: ``Memory.end`` counts what it keeps) and its :class:`Memory`.
    """
    steps = len(batches)

    def build_and_train() -> Loop:
        loop = build_loop(name, model_name, steps, device)
        x, y = batches[0]
        loop.window([(x[:1], y[:1])] * steps)
        loop.window(batches)
        return loop

    return allocator_memory(build_and_train, device)
