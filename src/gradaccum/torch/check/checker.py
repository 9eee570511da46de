"""Is accumulation exact for this model? One step on the full batch against N micro-batches.

Both runs start from the same weights and the same RNG state and take one plain SGD step with
lr 1, so a parameter's update is minus its window gradient. Every parameter and buffer is then
compared, and the modules that break equivalence are named (see :mod:`gradaccum.torch.check.hazards`).
With ``world_size=W`` the micro-batches run on W DDP-wrapped gloo processes instead
(:mod:`gradaccum.torch.check.ranks`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gradaccum.core.validate import check_positive_int
from gradaccum.torch.check.counts import count_hint
from gradaccum.torch.check.diffs import (
    buffer_diffs,
    changed_buffers,
    max_abs,
    param_diffs,
    scale,
    spread,
)
from gradaccum.torch.check.hazards import empty_micro_batches, find_hazards, for_ranks, unused_on_ranks
from gradaccum.torch.check.losses import LossFn, first_tensor, named_loss, random_targets
from gradaccum.torch.check.ranks import rank_windows
from gradaccum.torch.check.report import CheckReport, TensorDiff
from gradaccum.torch.check.runs import Run, full_step, micro_steps
from gradaccum.torch.check.samples import Batch, make_batch

__all__ = ["DEFAULT_TOLERANCES", "CheckReport", "TensorDiff", "check_equivalence"]

# (atol, rtol) per dtype: a tensor agrees when max|diff| <= atol + rtol * max|reference|.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-9),
    torch.float32: (1e-6, 1e-4),
}


def check_equivalence(
    model: nn.Module | Callable[[], nn.Module],
    sample: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, Any] | Sequence[int],
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
    world_size: int = 1,
    ddp_kwargs: Mapping[str, Any] | None = None,
) -> CheckReport:
    """Run one optimizer step on a full batch and on ``steps`` micro-batches; compare.

    Args:
        model: a module (copied, never changed) or a factory that builds one (called after
            ``torch.manual_seed(seed)``). It runs in training mode.
        sample: the full batch, split along dimension 0: a tensor, a tuple of tensors (passed as
            ``model(*sample)``) or a dict of keyword arguments (``model(**sample)``, as a Hugging
            Face model takes ``input_ids``, ``attention_mask`` and ``labels``; values that are not
            tensors go to every call unchanged); or the shape of one input sample: then the batch
            is ``steps * micro_batch`` standard-normal samples (token ids with ``vocab``).
        steps: the number of micro-batches (N) per rank; the batch size must be a multiple of
            ``steps * world_size``.
        micro_batch: samples per micro-batch when ``sample`` is a shape (per rank).
        targets: the full batch's targets; by default a dict sample's ``"labels"``, else random
            ones (normal for ``"mse"``, class indices for the cross-entropy losses), drawn from
            their own generator.
        loss: ``"mse"``, ``"cross-entropy"`` (classes on dimension 1), ``"token-cross-entropy"``
            (a language model's ``[..., vocab]`` logits against token ids, -100 ignored,
            item-weighted), ``"causal-lm"`` (a causal LM's own ``output.loss`` when it has one,
            else the cross-entropy of its logits against the labels shifted by one; item-weighted
            by ``count_tokens(labels, shift=True)``: a Hugging Face model given a dict sample
            with its ``labels``), or ``loss(output, targets)`` returning the batch's mean loss, or
            ``(mean loss, n_items)``: its mean over ``n_items`` items (tokens). A pair makes both
            runs item-weighted: the full batch's loss is the mean over all its items, and each
            micro-batch goes through ``acc.backward(loss, n_items)``.
        dtype: convert the model and floating inputs to this dtype (``None``: leave as is).
        atol: the absolute tolerance; by default from :data:`DEFAULT_TOLERANCES` for the least
            precise of the parameters' dtype and the loss's (a float32 loss of a float64 model,
            as Hugging Face computes it, is judged at float32's tolerance; the report says so).
        rtol: the relative tolerance, chosen the same way.
        seed: seeds the weights (factory), the random batch and the RNG state of both runs.
        device: where to run (``"cpu"`` with ``world_size > 1``).
        label: the model's name in the report.
        vocab: with ``sample`` a shape, draw int64 token ids in ``[0, vocab)`` instead of
            normal floats (for a model that starts with an embedding).
        world_size: W > 1 runs the micro-batches on W gloo processes on the CPU, each holding
            its contiguous share of the batch and wrapping the model in
            ``DistributedDataParallel``, through ``Accumulator(..., model=ddp_model)``, against
            one process on the full batch. The model (its class) and a callable loss must then
            be picklable: defined at a module's top level.
        ddp_kwargs: keyword arguments of ``DistributedDataParallel`` on the ranks
            (``{"find_unused_parameters": True}``).

    Returns:
        A :class:`CheckReport`.

    Raises:
        TypeError, ValueError: a bad argument (the message names it).
        gradaccum.torch.check.spawn.RankError: a rank raised, or the ranks hung.

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
    world = check_positive_int("world_size", world_size)
    _tolerance(dtype, atol, rtol)  # fail before building anything
    dev = torch.device(device)
    if world > 1 and dev.type != "cpu":
        raise ValueError(f"world_size={world} runs gloo processes on the CPU: device must be 'cpu', "
                         f"got {str(device)!r}")
    if ddp_kwargs is not None and (world == 1 or not isinstance(ddp_kwargs, Mapping)):
        raise ValueError(f"ddp_kwargs={ddp_kwargs!r} needs world_size > 1 and a dict")
    loss_fn = named_loss(loss)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        base = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
        if not isinstance(base, nn.Module):
            raise TypeError(f"model must be an nn.Module or a factory of one, got {type(base).__name__}")
        base = base.to(device=dev, dtype=dtype) if dtype is not None else base.to(dev)
        base.train()
        batch = make_batch(sample, steps * world, micro_batch, dtype, dev, seed, vocab)
    if batch.size % (steps * world):
        split = f"steps={steps}" if world == 1 else f"world_size={world} x steps={steps}"
        raise ValueError(f"the batch of {batch.size} samples does not split into {split} "
                         "equal micro-batches")
    if targets is None and isinstance(batch.kwargs.get("labels"), torch.Tensor):
        targets = batch.kwargs["labels"]
    full_model, micro_model = copy.deepcopy(base), copy.deepcopy(base)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        targets = _targets(full_model, batch, targets, loss, seed, dev)
        torch.manual_seed(seed)
        full = full_step(full_model, batch, targets, loss_fn, dev)
        torch.manual_seed(seed)
        micro = micro_steps(micro_model, batch, targets, loss_fn, steps * world, dev,
                            weighted=bool(full.counts))
    real_dtype = next((p.dtype for p in base.parameters()), dtype or torch.float32)
    judged = _least_precise([real_dtype, *full.dtypes, *micro.dtypes])
    atol, rtol = _tolerance(judged, atol, rtol)
    # A module is named for what it does, not for rounding: a Linear on 4 samples rounds otherwise
    # than on 16, which a zero tolerance on the parameters must not turn into "mixes samples".
    module_atol, module_rtol = (max(a, b) for a, b in zip((atol, rtol), _tolerance(judged, None, None),
                                                          strict=True))

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and max_abs(a, b) <= module_atol + module_rtol * scale(b)

    hazards = find_hazards(base, full.trace, micro.trace, steps * world,
                           changed_buffers(base, full_model), close)
    hazards += empty_micro_batches(micro.counts, steps, world)
    states = [{**dict(micro_model.named_parameters()), **dict(micro_model.named_buffers())}]
    if world > 1 and 0 not in micro.counts:
        results = rank_windows(base, batch, targets, loss, steps, world, bool(full.counts), ddp_kwargs)
        states = [{**r.params, **r.buffers} for r in results]
        hazards = for_ranks(hazards, base)
        if not (ddp_kwargs or {}).get("find_unused_parameters"):
            hazards += unused_on_ranks(base, [r.got_grad for r in results])
        micro = _merge(micro, [r.run for r in results])
    diffs = param_diffs(base, full_model, states, atol, rtol) + buffer_diffs(full_model, states, atol, rtol)
    settings = {"model": label or type(base).__name__, "batch": batch.size, "steps": steps,
                "micro_batch": batch.size // (steps * world), "dtype": _name(real_dtype),
                "loss_dtype": _name(_least_precise(full.dtypes)), "judged_dtype": _name(judged),
                "atol": atol, "rtol": rtol, "loss": loss if isinstance(loss, str) else "custom",
                "device": str(dev), "world_size": world, "rank_spread": spread(states),
                "n_items": full.counts[0] if full.counts else None,
                "micro_n_items": micro.counts or None, "count_hint": ""}
    ok = all(d.ok for d in diffs) and not hazards
    if not ok and full.counts and 0 not in micro.counts and not hazards:
        settings["count_hint"] = count_hint(targets, steps * world, full.losses[0], micro.losses,
                                            micro.counts, _least_precise(full.dtypes))
    # A named module makes the verdict negative even when the numbers agree: the agreement is
    # then an accident (e.g. the CPU generator drew one dropout layer's masks in batch order).
    return CheckReport(ok, diffs, hazards, settings)


def _targets(model: nn.Module, batch: Batch, targets: torch.Tensor | None, loss: str | LossFn,
             seed: int, device: torch.device) -> torch.Tensor:
    """The targets given, or random ones shaped like the model's output (from a copy's forward)."""
    if targets is not None:
        return targets.to(device)
    with torch.no_grad():
        out = batch.run(copy.deepcopy(model))
    return random_targets(first_tensor(out), loss, seed).to(device)


def _merge(micro: Run, ranks: list[Run]) -> Run:
    """The ranks' losses and counts in global micro-batch order (rank 0's first); the trace stays
    the one-process run's."""
    merged = Run(trace=micro.trace)
    for run in ranks:
        merged.losses += run.losses
        merged.dtypes += run.dtypes
        merged.counts += run.counts
    return merged


def _least_precise(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    floats = [d for d in dtypes if d.is_floating_point]
    return max(floats, key=lambda d: torch.finfo(d).eps, default=torch.float32)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _tolerance(dtype: torch.dtype | None, atol: float | None,
               rtol: float | None) -> tuple[float, float]:
    default = DEFAULT_TOLERANCES.get(dtype or torch.float32, DEFAULT_TOLERANCES[torch.float32])
    chosen = (default[0] if atol is None else atol, default[1] if rtol is None else rtol)
    for name, value in zip(("atol", "rtol"), chosen, strict=True):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(chosen[0]), float(chosen[1])

