"""Test your own accumulation loop: does it give the full batch's update, for any split?

``assert_accumulation_exact`` runs your update step (your model, optimizer and accumulation code
over a list of micro-batches: one optimizer step) on the same global batch split several ways,
on one process or on W gloo ranks, and compares each update with the full batch's. When one
differs it says how, in words: ``0.25x the full batch: divided by the steps twice``. Import it
explicitly (``import gradaccum`` does not load it)::

    from gradaccum.testing import assert_accumulation_exact

For pytest: it raises ``AssertionError``. See docs/TESTING.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradaccum.core.validate import check_positive_int
from gradaccum.torch.check.checker import DEFAULT_TOLERANCES
from gradaccum.torch.check.spawn import check_picklable, run_on_ranks
from gradaccum.torch.memory.split import batch_size, split_batch

__all__ = ["AccumulationReport", "SplitResult", "assert_accumulation_exact", "describe_update"]

StepFn = Callable[[nn.Module, torch.optim.Optimizer, list[Any]], Any]
Split = int | Sequence[int]


@dataclass(frozen=True)
class SplitResult:
    """One split's update against the full batch's.

    Attributes:
        split: the micro-batch sizes (per rank under ``world_size > 1``).
        ratio: the update's L2 norm over the full batch's (all parameters together).
        cosine: the cosine between the two updates (1: the same direction).
        max_abs: the largest absolute difference of any parameter (over ranks).
        ok: every parameter within ``atol + rtol * (its largest full-batch update)``.
        words: what the difference means.
    """

    split: tuple[int, ...]
    ratio: float
    cosine: float
    max_abs: float
    ok: bool
    words: str


@dataclass(frozen=True)
class AccumulationReport:
    """Every split's result; ``str()`` is one line per split."""

    results: list[SplitResult]
    world_size: int

    @property
    def exact(self) -> bool:
        """True when every split gave the full batch's update."""
        return all(r.ok for r in self.results)

    def __str__(self) -> str:
        where = "" if self.world_size == 1 else f" on each of {self.world_size} ranks"
        lines = [f"{'exact' if self.exact else 'NOT exact'}: your step against the full batch's update"]
        for r in self.results:
            count = f"{len(r.split)} micro-batch{'es' if len(r.split) > 1 else ''}"
            lines.append(f"  {count} of {'+'.join(map(str, r.split))}{where}: "
                         f"{'ok' if r.ok else 'differs'} (max abs diff {r.max_abs:.1e}): {r.words}")
        return "\n".join(lines)


def describe_update(ratio: float, cosine: float, micro_batches: int, ok: bool = False) -> str:
    """Say in words how an update compares with the full batch's.

    Args:
        ratio: its L2 norm over the full batch update's.
        cosine: the cosine between the two.
        micro_batches: how many micro-batches the window held (k).
        ok: the update agreed within the tolerance.

    Example:
        >>> describe_update(0.25, 1.0, 4)
        '0.25x the full batch: divided by the steps twice (the loss by N=4 and again the window)'
    """
    k = micro_batches
    if ok:
        return f"{ratio:.4g}x the full batch: exact"
    if ratio == 0:
        return "no update at all: the optimizer never stepped (a window left pending: flush it)"
    head = f"{ratio:.3g}x the full batch"
    if cosine < 1 - 1e-5:
        return (f"{head}, in another direction (cosine {cosine:.6f}): the samples are weighted "
                "otherwise than in the full batch: a per-micro-batch mean instead of per-token (or "
                "per-item; pass n_items), or a layer that mixes samples or draws random numbers "
                "(gradaccum.check_equivalence names it)")

    def near(x: float) -> bool:
        return math.isclose(ratio, x, rel_tol=1e-4)

    if k > 1 and near(1 / k):
        return f"{head}: divided by the steps twice (the loss by N={k} and again the window)"
    if k > 1 and near(float(k)):
        return f"{head}: not divided by the steps: the sum of {k} micro-batch means, not their mean"
    short = next((m for m in range(k + 1, 8 * k + 1) if near(k / m)), None)
    if short is not None:
        return (f"{head}: {k} micro-batches divided by {short}: a short last window divided by "
                f"N={short}, not by the {k} it holds")
    return f"{head}: the right direction at the wrong scale: a loss divided by the wrong count"


def assert_accumulation_exact(
    step_fn: StepFn,
    make_model: Callable[[], nn.Module],
    batch: Any,
    *,
    splits: Sequence[Split] = (2, 4),
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    world_size: int = 1,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    timeout: float = 300.0,
) -> AccumulationReport:
    """Assert that ``step_fn`` gives the full batch's update for every split of ``batch``.

    Args:
        step_fn: your update step, ``step_fn(model, optimizer, micro_batches)``: it runs your
            accumulation code over the list and takes one optimizer step (a window).
        make_model: builds the model (called after ``torch.manual_seed(seed)``). float64
            parameters make any real difference stand far above rounding.
        batch: the global batch: a tensor, or a tuple, list or dict of tensors (split on dim 0).
        splits: an int ``k`` (``k`` equal micro-batches) or a list of micro-batch sizes, each.
        make_optimizer: ``make_optimizer(model) -> optimizer``; by default SGD with lr 1, whose
            update is minus the window gradient, so the norm ratio is the gradient's. (Adam's
            first update is nearly ``sign(gradient)``: a gradient at the wrong scale hides in it.)
        loss_fn: ``loss_fn(model, batch) -> mean loss``: the reference is then one plain
            optimizer step on the whole batch's loss. Without it, the reference is ``step_fn``
            on the whole batch as one micro-batch, which cannot see a step that hard-codes N.
        world_size: W > 1 runs each split on W gloo processes on the CPU, each with its share
            of the batch (``batch / W``, split as ``splits`` say) and the model wrapped in
            ``DistributedDataParallel`` (pass it as ``model=`` to your Accumulator); the
            reference runs in one process. ``step_fn``, ``make_model``, ``make_optimizer`` and
            the batch travel by pickle: define them at a module's top level.
        atol, rtol: a parameter agrees when ``max|diff| <= atol + rtol * its largest
            full-batch update``; by default from the parameters' dtype (1e-12 and 1e-9 in float64,
            1e-6 and 1e-4 in float32).
        seed: seeds the model and every run's RNG state.
        timeout: seconds for the distributed run.

    Returns:
        The :class:`AccumulationReport`, when every split is exact.

    Raises:
        AssertionError: a split differs; the message has a line per split, in words.
        TypeError, ValueError: a bad argument (named).

    Example:
        >>> import gradaccum
        >>> def step(model, opt, micro_batches):
        ...     acc = gradaccum.Accumulator(opt, len(micro_batches))
        ...     for x, y in micro_batches:
        ...         acc.backward(nn.functional.mse_loss(model(x), y))
        >>> data = (torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64))
        >>> assert_accumulation_exact(step, lambda: nn.Linear(3, 1).double(), data).exact
        True
    """
    world = check_positive_int("world_size", world_size)
    total = batch_size(batch)
    if total % world:
        raise ValueError(f"the batch of {total} items does not split over world_size={world} ranks")
    sizes = [_sizes(s, total // world) for s in splits]
    torch.manual_seed(seed)
    base = make_model()
    if not isinstance(base, nn.Module):
        raise TypeError(f"make_model must return an nn.Module, got {type(base).__name__}")
    start = {k: v.detach().clone() for k, v in base.state_dict().items()}
    dtype = next((p.dtype for p in base.parameters()), torch.float32)
    default = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])
    atol, rtol = (default[0] if atol is None else atol), (default[1] if rtol is None else rtol)
    job = {"step": step_fn, "model": make_model, "optimizer": make_optimizer, "state": start,
           "batch": batch, "sizes": sizes, "seed": seed, "world": world}
    before = _params(_build(job))
    reference = _delta(_reference(job, loss_fn), before)
    if world == 1:
        runs = [[_delta(p, before)] for p in _splits_on_rank(0, 1, job)]
    else:
        for what in ("step_fn", "make_model", "make_optimizer"):
            check_picklable(what, job[{"step_fn": "step", "make_model": "model",
                                       "make_optimizer": "optimizer"}[what]])
        per_rank = run_on_ranks(_splits_on_rank, job, world, timeout=timeout)
        runs = [[_delta(rank[i], before) for rank in per_rank] for i in range(len(sizes))]
    results = [_compare(s, r, reference, atol, rtol) for s, r in zip(sizes, runs, strict=True)]
    report = AccumulationReport(results, world)
    if not report.exact:
        raise AssertionError(str(report))
    return report


def _sizes(split: Split, total: int) -> tuple[int, ...]:
    if isinstance(split, bool):
        raise ValueError(f"splits: {split!r} is not a number of micro-batches or a list of sizes")
    if isinstance(split, int):
        if split < 1 or total % split:
            raise ValueError(f"splits: {split} equal micro-batches do not divide {total} items; "
                             "give the sizes instead, e.g. [3, 3, 2]")
        return (total // split,) * split
    sizes = tuple(split)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes) \
            or sum(sizes) != total:
        raise ValueError(f"splits: {list(sizes)} must be sizes >= 1 summing to the {total} items "
                         "of the batch (per rank)")
    return sizes


def _build(job: dict[str, Any]) -> nn.Module:
    model: nn.Module = job["model"]()
    model.load_state_dict(job["state"])
    return model


def _optimizer(job: dict[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    make = job["optimizer"]
    return make(model) if make is not None else torch.optim.SGD(model.parameters(), lr=1.0)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = getattr(model, "module", model)  # DDP's wrapped module
    return {n: p.detach().clone() for n, p in inner.named_parameters()}


def _delta(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: after[n].double() - before[n].double() for n in before}


def _reference(job: dict[str, Any],
               loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(job["seed"])
    model = _build(job)
    opt = _optimizer(job, model)
    if loss_fn is None:
        job["step"](model, opt, [job["batch"]])
    else:
        opt.zero_grad()
        torch.autograd.backward(loss_fn(model, job["batch"]))
        opt.step()
    return _params(model)


def _splits_on_rank(rank: int, world: int, job: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """Every split of this rank's share, each from the start (rank side too)."""
    share = batch_size(job["batch"]) // world
    mine = split_batch(job["batch"], [share] * world)[rank]
    out = []
    for sizes in job["sizes"]:
        torch.manual_seed(job["seed"] + rank)
        model = _build(job)
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
        job["step"](model, _optimizer(job, model), split_batch(mine, list(sizes)))
        out.append(_params(model))
    return out


def _compare(sizes: tuple[int, ...], runs: list[dict[str, torch.Tensor]], ref: dict[str, torch.Tensor],
             atol: float, rtol: float) -> SplitResult:
    ok, worst = True, 0.0
    for name, r in ref.items():
        scale = float(r.abs().max()) if r.numel() else 0.0
        diff = max(float((run[name] - r).abs().max()) if r.numel() else 0.0 for run in runs)
        ok, worst = ok and diff <= atol + rtol * scale, max(worst, diff)
    if len(runs) > 1:
        apart = max(float((run[n] - runs[0][n]).abs().max())
                    for run in runs[1:] for n in ref if ref[n].numel())
        if apart > atol + rtol * max(float(r.abs().max()) for r in ref.values() if r.numel()):
            return SplitResult(sizes, math.nan, math.nan, worst, False,
                               f"the ranks ended {apart:.1e} apart: each rank stepped on its own "
                               "gradient or count (pass model=ddp_model to the Accumulator)")
    flat_ref = torch.cat([r.flatten() for r in ref.values()])
    flat = torch.cat([runs[0][n].flatten() for n in ref])
    ref_norm, norm = float(flat_ref.norm()), float(flat.norm())
    ratio = norm / ref_norm if ref_norm > 0 else (1.0 if norm == 0 else math.inf)
    cosine = float(flat @ flat_ref) / (norm * ref_norm) if norm > 0 and ref_norm > 0 else 1.0
    return SplitResult(sizes, ratio, cosine, worst, ok, describe_update(ratio, cosine, len(sizes), ok))
