"""Section c (exactness): each method's parameters against full-batch training, in float64.

Two cases where accumulation is easy to get wrong:

* ``uneven``: the MNIST MLP, 10 micro-batches of 8 in windows of 4: the last window holds 2.
  The full batch steps on 32, 32 and 16 items, each the mean over its items.
* ``tokens``: a tiny language model on padded sequences, a token-mean loss: each window is the
  mean over its real (non-padding) tokens, not the mean of the micro-batches' means.

Methods: gradaccum (``flush()`` at the end of data; ``n_items`` = real tokens), Accelerate as its
guide shows (``accumulate()`` and ``accelerator.backward`` over a prepared DataLoader, which ends
the last window at the end of the data), Accelerate with its guide's recipe for samples of
variable size (pre-fetch the window, count its items, sum-reduced loss times N over the count),
and the naive loop (``loss / N``, step every N micro-batches and at the end of the data).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gradaccum.bench.loops import accelerate_available
from gradaccum.demos.models import build_model
from gradaccum.torch import Accumulator

__all__ = ["CASES", "METHODS", "ExactCase", "run_exactness"]

PAD, LR = -100, 0.1
METHODS = ("gradaccum", "accelerate", "accelerate-recipe", "naive")


@dataclass(frozen=True)
class ExactCase:
    """One experiment: a float64 model, data, micro-batch and window size (N)."""

    name: str
    model: Callable[[], nn.Module]
    data: Callable[[Path | None], tuple[torch.Tensor, torch.Tensor]]  # given the MNIST folder
    micro_batch: int
    steps: int


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    logits = model(x)
    if logits.dim() == 3:  # a language model: one prediction per token
        logits, y = logits.flatten(0, 1), y.flatten()
    return nn.functional.cross_entropy(logits, y, ignore_index=PAD, reduction=reduction)


def _items(y: torch.Tensor) -> torch.Tensor:
    return (y != PAD).sum()


def _mnist(data_dir: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
    from gradaccum.demos.mnist import mnist_tensors

    x, y = mnist_tensors("train", data_dir, limit=80)
    return x.double(), y


def _tiny_lm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 16), nn.Tanh(), nn.Linear(16, 32)).double()


def _padded(_data_dir: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (24, 12), generator=g)
    targets = torch.randint(0, 32, (24, 12), generator=g)
    lengths = torch.randint(1, 13, (24,), generator=g)
    targets[torch.arange(12) >= lengths[:, None]] = PAD
    return tokens, targets


CASES = (
    ExactCase("uneven", lambda: build_model("mlp", seed=0).double(), _mnist, 8, 4),
    ExactCase("tokens", _tiny_lm, _padded, 3, 4),
)


def _windows(case: ExactCase, x: torch.Tensor) -> list[slice]:
    size = case.micro_batch * case.steps
    return [slice(i, min(i + size, len(x))) for i in range(0, len(x), size)]


def _micro(case: ExactCase, x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    return zip(torch.split(x, case.micro_batch), torch.split(y, case.micro_batch), strict=True)


def _reference(case: ExactCase, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for w in _windows(case, x):
        torch.autograd.backward(_loss(model, x[w], y[w]))
        opt.step()
        opt.zero_grad()


def _gradaccum(case: ExactCase, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=LR), case.steps)
    for xb, yb in _micro(case, x, y):
        acc.backward(_loss(model, xb, yb), n_items=_items(yb) if case.name == "tokens" else None)
    acc.flush()


def _naive(case: ExactCase, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches = list(_micro(case, x, y))
    for i, (xb, yb) in enumerate(batches):
        torch.autograd.backward(_loss(model, xb, yb) / case.steps)
        if (i + 1) % case.steps == 0 or i + 1 == len(batches):
            opt.step()
            opt.zero_grad()


def _prepared(case: ExactCase, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple:  # type: ignore[type-arg]
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    # No cpu=True: Accelerate's state is per process, and a CUDA run of the overhead section
    # may have set it up on the GPU already; parameters are compared on the CPU.
    accelerator = Accelerator(gradient_accumulation_steps=case.steps)
    loader = DataLoader(TensorDataset(x, y), batch_size=case.micro_batch)
    model, opt, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR), loader)
    return accelerator, model, opt, loader


def _accelerate(case: ExactCase, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    accelerator, model, opt, loader = _prepared(case, model, x, y)
    for xb, yb in loader:
        with accelerator.accumulate(model):
            accelerator.backward(_loss(model, xb, yb))
            opt.step()
            opt.zero_grad()


def _accelerate_recipe(case: ExactCase, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    accelerator, model, opt, loader = _prepared(case, model, x, y)
    batches = iter(loader)
    for w in _windows(case, x):
        window = [next(batches) for _ in range(-(-(w.stop - w.start) // case.micro_batch))]
        n_items = accelerator.gather(sum(_items(yb) for _, yb in window)).sum()
        for xb, yb in window:
            # accelerator.backward divides by N, hence the factor N (and world size) in the guide.
            loss = _loss(model, xb, yb, "sum") * case.steps * accelerator.num_processes / n_items
            accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    for _ in batches:  # run the loader to its end, so that Accelerate forgets it
        pass


RUNNERS = {"gradaccum": _gradaccum, "accelerate": _accelerate,
           "accelerate-recipe": _accelerate_recipe, "naive": _naive}


@torch.no_grad()
def max_param_difference(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between the two models' parameters."""
    return max(float((p.cpu() - q.cpu()).abs().max())
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


def run_exactness(data_dir: Path | None = None) -> dict[str, dict[str, float | None]]:
    """Run every method on every case (``data_dir``: where MNIST is, see
    :func:`gradaccum.demos.mnist.load_mnist`).

    Returns:
        case -> method -> max |parameter difference| against the full batch (``None``: Accelerate
        is not installed).

    Example:
        >>> run_exactness()["uneven"]["gradaccum"] < 1e-12  # doctest: +SKIP
        True
    """
    results: dict[str, dict[str, float | None]] = {}
    for case in CASES:
        x, y = case.data(data_dir)
        initial = case.model()
        reference = copy.deepcopy(initial)
        _reference(case, reference, x, y)
        row: dict[str, float | None] = {}
        for method in METHODS:
            if method.startswith("accelerate") and not accelerate_available():
                row[method] = None
                continue
            model = copy.deepcopy(initial)
            RUNNERS[method](case, model, x, y)
            row[method] = max_param_difference(model, reference)
        results[case.name] = row
    return results
