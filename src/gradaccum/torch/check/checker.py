"""Is accumulation exact for this model? One step on the full batch against N micro-batches.

Both runs start from the same weights and the same RNG state and take one plain SGD step with
lr 1, so a parameter's update is minus its window gradient. Every parameter and buffer is then
compared, and the modules that break equivalence are named (see :mod:`gradaccum.torch.check.hazards`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gradaccum.core.validate import check_positive_int
from gradaccum.torch.accumulator import Accumulator
from gradaccum.torch.check.hazards import find_hazards
from gradaccum.torch.check.losses import (
    LossFn,
    first_tensor,
    item_count,
    named_loss,
    random_targets,
    split_loss,
)
from gradaccum.torch.check.report import CheckReport, TensorDiff
from gradaccum.torch.check.tracing import ModuleTrace, trace_modules

__all__ = ["DEFAULT_TOLERANCES", "CheckReport", "TensorDiff", "check_equivalence"]

# (atol, rtol) per dtype: a tensor agrees when max|diff| <= atol + rtol * max|reference|.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-9),
    torch.float32: (1e-6, 1e-4),
}


def check_equivalence(
    model: nn.Module | Callable[[], nn.Module],
    sample: torch.Tensor | Sequence[torch.Tensor] | Sequence[int],
    steps: int = 4,
    *,
    micro_batch: int = 8,
    targets: torch.Tensor | None = None,
    loss: str | LossFn = "mse",
    dtype: torch.dtype | None = torch.float64,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    label: str = "",
    vocab: int | None = None,
) -> CheckReport:
    """Run one optimizer step on a full batch and on ``steps`` micro-batches; compare.

    Args:
        model: a module (copied, never changed) or a factory that builds one (called after
            ``torch.manual_seed(seed)``). It runs in training mode.
        sample: the full batch (a tensor, or a tuple of tensors passed as ``model(*sample)``,
            split along dimension 0), or the shape of one input sample: then the batch is
            ``steps * micro_batch`` standard-normal samples (token ids with ``vocab``).
        steps: the number of micro-batches (N); the batch size must be a multiple of it.
        micro_batch: samples per micro-batch when ``sample`` is a shape.
        targets: the full batch's targets; by default random ones (normal for ``"mse"``, class
            indices for the cross-entropy losses), drawn from their own generator.
        loss: ``"mse"``, ``"cross-entropy"`` (classes on dimension 1), ``"token-cross-entropy"``
            (a language model's ``[..., vocab]`` logits against token ids, -100 ignored,
            item-weighted), or ``loss(output, targets)`` returning the batch's mean loss, or
            ``(mean loss, n_items)``: its mean over ``n_items`` items (tokens). A pair makes both
            runs item-weighted: the full batch's loss is the mean over all its items, and each
            micro-batch goes through ``acc.backward(loss, n_items)``.
        dtype: convert the model and floating inputs to this dtype (``None``: leave as is).
        atol: the absolute tolerance; default from :data:`DEFAULT_TOLERANCES` for the dtype.
        rtol: the relative tolerance; default from :data:`DEFAULT_TOLERANCES` for the dtype.
        seed: seeds the weights (factory), the random batch and the RNG state of both runs.
        device: where to run.
        label: the model's name in the report.
        vocab: with ``sample`` a shape, draw int64 token ids in ``[0, vocab)`` instead of
            normal floats (for a model that starts with an embedding).

    Returns:
        A :class:`CheckReport`.

    Raises:
        TypeError, ValueError: a bad argument (the message names it).

    Example:
        >>> net = lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        >>> check_equivalence(net, (4,), steps=2).equivalent
        True
        >>> check_equivalence(lambda: nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)),
        ...                   (4,), steps=2).hazards[0].module
        '1'
        >>> lm = lambda: nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 11))
        >>> check_equivalence(lm, (6,), steps=2, vocab=11, loss="token-cross-entropy").equivalent
        True
    """
    steps = check_positive_int("steps", steps)
    _tolerance(dtype, atol, rtol)  # fail before building anything
    dev = torch.device(device)
    loss_fn = named_loss(loss)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        base = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
        if not isinstance(base, nn.Module):
            raise TypeError(f"model must be an nn.Module or a factory of one, got {type(base).__name__}")
        base = base.to(device=dev, dtype=dtype) if dtype is not None else base.to(dev)
        base.train()
        inputs = _inputs(sample, steps, micro_batch, dtype, dev, seed, vocab)
    batch = inputs[0].shape[0]
    if batch % steps:
        raise ValueError(f"the batch of {batch} samples does not split into steps={steps} "
                         "equal micro-batches")
    full_model, micro_model = copy.deepcopy(base), copy.deepcopy(base)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        full, targets, n_full = _full_step(full_model, inputs, targets, loss_fn, loss, seed, dev)
        torch.manual_seed(seed)
        micro, n_micro = _micro_steps(micro_model, inputs, targets, loss_fn, steps, dev,
                                      weighted=n_full is not None)
    real_dtype = next((p.dtype for p in base.parameters()), dtype or torch.float32)
    atol, rtol = _tolerance(real_dtype, atol, rtol)

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and _max_abs(a, b) <= atol + rtol * _scale(b)

    diffs = _param_diffs(base, full_model, micro_model, atol, rtol)
    diffs += _buffer_diffs(full_model, micro_model, atol, rtol)
    hazards = find_hazards(base, full, micro, steps, _changed_buffers(base, full_model), close)
    settings = {"model": label or type(base).__name__, "batch": batch, "steps": steps,
                "micro_batch": batch // steps, "dtype": str(real_dtype).replace("torch.", ""),
                "atol": atol, "rtol": rtol, "loss": loss if isinstance(loss, str) else "custom",
                "device": str(dev), "n_items": n_full, "micro_n_items": n_micro}
    # A named module makes the verdict negative even when the numbers agree: the agreement is
    # then an accident (e.g. the CPU generator drew one dropout layer's masks in batch order).
    return CheckReport(all(d.ok for d in diffs) and not hazards, diffs, hazards, settings)


def _inputs(sample: Any, steps: int, micro_batch: int, dtype: torch.dtype | None,
            device: torch.device, seed: int, vocab: int | None) -> list[torch.Tensor]:
    is_shape = isinstance(sample, (tuple, list)) and sample and all(isinstance(s, int) for s in sample)
    if vocab is not None:
        check_positive_int("vocab", vocab)
        if not is_shape:
            raise ValueError(f"vocab={vocab} draws token ids for a sample shape; sample is a "
                             f"{type(sample).__name__} (it holds its own token ids)")
    if isinstance(sample, torch.Tensor):
        tensors = [sample]
    elif is_shape:
        shape = (steps * check_positive_int("micro_batch", micro_batch), *sample)
        gen = torch.Generator().manual_seed(seed)
        tensors = [torch.randn(shape, generator=gen) if vocab is None
                   else torch.randint(0, vocab, shape, generator=gen)]
    elif isinstance(sample, (tuple, list)) and sample and all(isinstance(s, torch.Tensor) for s in sample):
        tensors = list(sample)
    else:
        raise TypeError(f"sample must be a tensor, a tuple of tensors or an input shape, got {sample!r}")
    if len({t.shape[0] if t.dim() else -1 for t in tensors}) != 1 or tensors[0].dim() == 0:
        raise ValueError(f"sample tensors must share their first (batch) dimension, got shapes "
                         f"{[tuple(t.shape) for t in tensors]}")
    cast = [t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in tensors]
    return [t.to(device) for t in cast]


def _full_step(model: nn.Module, inputs: list[torch.Tensor], targets: torch.Tensor | None,
               loss_fn: LossFn, loss: str | LossFn, seed: int,
               device: torch.device) -> tuple[ModuleTrace, torch.Tensor, float | None]:
    """One SGD step on the whole batch; returns its item count when the loss gives one."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with trace_modules(model, inputs[0].shape[0], device) as trace:
        out = model(*inputs)
    if targets is None:
        targets = random_targets(first_tensor(out), loss, seed)
    value, n_items = split_loss(loss_fn(out, targets.to(device)), "the full batch")
    # An item-weighted full batch needs nothing more: its loss is already the mean over all items.
    torch.autograd.backward(value)
    opt.step()
    return trace, targets.to(device), None if n_items is None else item_count(n_items, "the full batch")


def _micro_steps(model: nn.Module, inputs: list[torch.Tensor], targets: torch.Tensor,
                 loss_fn: LossFn, steps: int, device: torch.device,
                 weighted: bool) -> tuple[ModuleTrace, list[float] | None]:
    """The window through an Accumulator; returns the micro-batches' item counts when weighted."""
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=1.0), steps)
    size = inputs[0].shape[0] // steps
    counts: list[float] = []
    with trace_modules(model, size, device) as trace:
        for i in range(steps):
            part = slice(i * size, (i + 1) * size)
            where = f"micro-batch {i}"
            value, n_items = split_loss(loss_fn(model(*(t[part] for t in inputs)), targets[part]), where)
            if (n_items is not None) != weighted:
                raise TypeError(f"loss returned {'a bare loss' if weighted else '(loss, n_items)'} on "
                                f"{where} but {'(loss, n_items)' if weighted else 'a bare loss'} on "
                                "the full batch: return the same form for every batch")
            if weighted:
                counts.append(item_count(n_items, where))
            acc.backward(value, n_items)
    return trace, counts if weighted else None


def _tolerance(dtype: torch.dtype | None, atol: float | None,
               rtol: float | None) -> tuple[float, float]:
    default = DEFAULT_TOLERANCES.get(dtype or torch.float32, DEFAULT_TOLERANCES[torch.float32])
    chosen = (default[0] if atol is None else atol, default[1] if rtol is None else rtol)
    for name, value in zip(("atol", "rtol"), chosen, strict=True):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(chosen[0]), float(chosen[1])


def _scale(t: torch.Tensor) -> float:
    return float(t.double().abs().max()) if t.numel() else 0.0


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


def _param_diffs(base: nn.Module, full: nn.Module, micro: nn.Module, atol: float,
                 rtol: float) -> list[TensorDiff]:
    rows = []
    for (name, p0), pf, pm in zip(base.named_parameters(), full.parameters(), micro.parameters(),
                                  strict=True):
        scale = _max_abs(pf.detach(), p0.detach())  # the full-batch run's largest update
        diff = _max_abs(pf.detach(), pm.detach())
        rows.append(TensorDiff(name, "param", tuple(p0.shape), diff, _rel(diff, scale),
                               diff <= atol + rtol * scale, updated=scale > 0 or diff > 0))
    return rows


def _buffer_diffs(full: nn.Module, micro: nn.Module, atol: float, rtol: float) -> list[TensorDiff]:
    rows = []
    for (name, bf), bm in zip(full.named_buffers(), micro.buffers(), strict=True):
        scale = _scale(bf)
        diff = _max_abs(bf, bm)
        rows.append(TensorDiff(name, "buffer", tuple(bf.shape), diff, _rel(diff, scale),
                               diff <= atol + rtol * scale))
    return rows


def _rel(diff: float, scale: float) -> float:
    if diff == 0:
        return 0.0
    return diff / scale if scale > 0 else float("inf")


def _changed_buffers(base: nn.Module, full: nn.Module) -> dict[str, list[str]]:
    changed: dict[str, list[str]] = {}
    for (name, module), after in zip(base.named_modules(), full.modules(), strict=True):
        for (bname, b0), b1 in zip(module.named_buffers(recurse=False),
                                   after.buffers(recurse=False), strict=True):
            if not torch.equal(b0, b1):
                changed.setdefault(name, []).append(bname)
    return changed
