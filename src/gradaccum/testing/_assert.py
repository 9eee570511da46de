"""``assert_accumulation_exact``: a user's update step against the full batch, for several splits,
over several windows of a scheduled learning rate, on one process or on W gloo ranks."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gradaccum.core.validate import check_optional_positive_float, check_positive_int
from gradaccum.testing._compare import compare
from gradaccum.testing._diagnose import Context, diagnose
from gradaccum.testing._report import AccumulationReport, SplitResult
from gradaccum.testing._runs import Job, full_batch_reference, params_of, splits_on_rank
from gradaccum.torch.check.checker import DEFAULT_TOLERANCES
from gradaccum.torch.check.spawn import check_picklable, run_on_ranks
from gradaccum.torch.memory.split import batch_size

__all__ = ["assert_accumulation_exact"]

StepFn = Callable[..., Any]
Split = int | Sequence[int]
# How close a hypothesis must come to the gradient the optimizer saw, by the parameters' dtype.
EVIDENCE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3}


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
    windows: int = 3,
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    clip_norm: float | None = None,
) -> AccumulationReport:
    """Assert that ``step_fn`` gives the full batch's updates for every split of ``batch``.

    Each split runs ``windows`` windows (the same batch each time, the parameters moving) with a
    learning-rate schedule, and every window's parameters are compared with a full-batch
    reference's. When one differs, the step runs on more splits (1 to 4 micro-batches) and a
    cause is named only when a single known mistake gives every gradient seen; otherwise the
    message gives the difference and lists the candidates.

    Args:
        step_fn: your update step, ``step_fn(model, optimizer, micro_batches)``: it runs your
            accumulation code over the list and takes one optimizer step (a window). With a
            parameter named ``scheduler`` it is called with ``scheduler=`` and steps it itself
            (or gives it to its Accumulator); otherwise the helper steps it after each window.
        make_model: builds the model (called after ``torch.manual_seed(seed)``). float64
            parameters make any real difference stand far above rounding.
        batch: the global batch: a tensor, or a tuple, list or dict of tensors (split on dim 0).
        splits: an int ``k`` (``k`` equal micro-batches) or a list of micro-batch sizes, each.
        make_optimizer: ``make_optimizer(model) -> optimizer``; by default SGD with lr 1.
        loss_fn: ``loss_fn(model, batch) -> mean loss``: the reference is then one plain
            optimizer step per window on the whole batch's loss, clipped at ``clip_norm``, and
            the diagnosis can test weightings (a mean of means, a token count). Without it the
            reference is ``step_fn`` on the whole batch as one micro-batch, which cannot see a
            step that hard-codes N or divides by a wrong count.
        world_size: W > 1 runs each split on W gloo processes on the CPU, each with its share
            of the batch (``batch / W``, split as ``splits`` say) and the model wrapped in
            ``DistributedDataParallel`` (pass it as ``model=`` to your Accumulator); the
            reference runs in one process. ``step_fn``, ``make_model``, ``make_optimizer``,
            ``make_scheduler`` and the batch travel by pickle: define them at a module's top level.
        atol: the absolute tolerance: a parameter agrees when ``max|diff| <= atol + rtol *
            its largest full-batch move``; by default from the parameters' dtype (1e-12 in
            float64, 1e-6 in float32).
        rtol: the relative tolerance of that test; by default 1e-9 in float64, 1e-4 in float32.
        seed: seeds the model and every run's RNG state.
        timeout: seconds for the distributed run.
        windows: optimizer steps per run (at least 3 to see a forgotten ``zero_grad`` and a
            scheduler stepped per micro-batch).
        make_scheduler: ``make_scheduler(optimizer) -> scheduler``; by default a ``LambdaLR``
            that halves the learning rate at every window.
        clip_norm: the gradient-norm clip of your loop, applied by the reference; by default
            the ``clip_norm`` of the gradaccum Accumulator that steps your optimizer, if any.

    Returns:
        The :class:`AccumulationReport`, when every split is exact.

    Raises:
        AssertionError: a split differs; the message has a line per split, then the evidence.
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
    n_windows = check_positive_int("windows", windows)
    clip_arg = check_optional_positive_float("clip_norm", clip_norm)
    for name, fn in (("step_fn", step_fn), ("make_model", make_model), ("make_optimizer", make_optimizer),
                     ("make_scheduler", make_scheduler), ("loss_fn", loss_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    total = batch_size(batch)
    if total % world:
        raise ValueError(f"the batch of {total} items does not split over world_size={world} ranks")
    sizes = [_sizes(s, total // world) for s in splits]
    torch.manual_seed(seed)
    base = make_model()
    if not isinstance(base, nn.Module):
        raise TypeError(f"make_model must return an nn.Module, got {type(base).__name__}")
    start = params_of(base)
    dtype = next((p.dtype for p in base.parameters()), torch.float32)
    default = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])
    atol, rtol = (default[0] if atol is None else atol), (default[1] if rtol is None else rtol)
    job = Job(step_fn, make_model, make_optimizer, make_scheduler,
              {k: v.detach().clone() for k, v in base.state_dict().items()}, batch, sizes, seed, world,
              n_windows, _takes_scheduler(step_fn), tuple(start))
    runs = _run_splits(job, timeout)
    found = next((t.clip_norm for run in runs for t in run if t.accumulator), None)
    clip = clip_arg if clip_arg is not None else found
    ref = full_batch_reference(job, loss_fn, clip)
    compared = [compare(s, r, ref, start, atol, rtol) for s, r in zip(sizes, runs, strict=True)]
    for c in compared:
        error = c.traces[0].error
        if c.window is None and error is not None:
            raise error  # a later window raised, and no earlier one explains it
    ctx = Context(job, ref, loss_fn, clip, EVIDENCE_TOLERANCE.get(dtype, 1e-2),
                  {s: r[0] for s, r in zip(sizes, runs, strict=True)} if world == 1 else {})
    results, why = [], []
    for c in compared:
        if c.window is None:
            results.append(SplitResult(c.sizes, c.ratio, c.cosine, c.max_abs, True,
                                       f"{c.ratio:.4g}x the full batch: exact"))
            continue
        finding = diagnose(c, ctx)
        results.append(SplitResult(c.sizes, c.ratio, c.cosine, c.max_abs, False, finding.words, c.window + 1))
        if finding.why and finding.why not in why:
            why.append(finding.why)
    setup = _setup(n_windows, make_scheduler, clip, clip_arg is None and found is not None)
    report = AccumulationReport(results, world, n_windows, tuple(why), setup)
    if not report.exact:
        raise AssertionError(str(report))
    return report


def _takes_scheduler(step_fn: StepFn) -> bool:
    try:
        return "scheduler" in inspect.signature(step_fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _run_splits(job: Job, timeout: float) -> list[list[Any]]:
    """Every split's traces, one per rank."""
    if job.world == 1:
        return [[t] for t in splits_on_rank(0, 1, job)]
    for what, fn in (("step_fn", job.step), ("make_model", job.model), ("make_optimizer", job.optimizer),
                     ("make_scheduler", job.scheduler)):
        check_picklable(what, fn)
    per_rank = run_on_ranks(splits_on_rank, job, job.world, timeout=timeout)
    return [[rank[i] for rank in per_rank] for i in range(len(job.sizes))]


def _setup(windows: int, make_scheduler: Any, clip: float | None, found: bool) -> str:
    schedule = "your scheduler" if make_scheduler is not None else "the learning rate halved at each"
    clipping = "no clipping" if clip is None else f"clipped at {clip:g}" + (
        " as your Accumulator clips" if found else "")
    return f"{windows} windows, {schedule}{' window' if make_scheduler is None else ''}, {clipping}"


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
