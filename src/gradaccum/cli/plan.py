"""``gradaccum plan``: what a training step needs in memory, and the micro-batch x steps that fit.

Probe windows at several micro-batch sizes measure the peak; the line fitted through them
predicts the peak at any micro-batch, and with a global batch and a budget, the recommendation. ``--check M``
measures the real peak at a micro-batch the probes did not use and prints both numbers.
"""

from __future__ import annotations

import argparse
from typing import Any

from gradaccum.cli._errors import UsageError, model_raised, one_line
from gradaccum.cli._options import check_device, positive_int, seed_int
from gradaccum.core.memory import DEFAULT_PROBES, check_probe_sizes

__all__ = ["add_parser", "load_model"]

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
DTYPES = ("float32", "float64", "bfloat16", "float16")
RECOMMENDED = 0  # --check without a size: check the recommendation
MAX_BUDGET = 2**60  # 1 EiB: more than any machine has


def load_model(spec: str, seed: int = 0) -> tuple[Any, tuple[int, ...] | None]:
    """Build a model from a demo name or an importable ``module:factory`` (as ``gradaccum check``).

    Returns:
        ``(model, sample_shape)``; the shape is known for the demo models, else ``None``.

    Raises:
        ValueError, TypeError, ImportError: see :func:`gradaccum.cli.check.load_factory`; also a
            factory that returns something other than an ``nn.Module``.

    Example:
        >>> model, shape = load_model("bench-cnn")
        >>> shape
        (3, 64, 64)
    """
    import torch

    from gradaccum.cli.check import load_factory

    factory, shape = load_factory(spec)
    torch.manual_seed(seed)
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"--model {spec!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model, shape


def _optimizer(name: str, params: Any) -> Any:
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if name == "momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=1e-4)


def _table(est: Any, sizes: list[int], budget: int | None) -> list[str]:
    from gradaccum.core.memory import format_bytes

    lines = [f"  {'micro-batch':>11}  {'predicted peak':>14}" + ("  fits" if budget else "")]
    for m in sizes:
        fits = ("  yes" if est.peak(m) <= budget else "  no") if budget else ""
        lines.append(f"  {m:>11}  {format_bytes(est.peak(m)):>14}{fits}")
    return lines


def _check(est: Any, model: Any, optimizer: Any, shape: tuple[int, ...], micro: int, steps: int) -> None:
    from gradaccum.core.memory import format_bytes
    from gradaccum.torch.memory.probe import measure_peak

    measured = measure_peak(model, optimizer, shape, micro, steps=steps)
    predicted = est.peak(micro)
    print(f"check at micro-batch {micro} x {steps} steps: predicted {format_bytes(predicted)} "
          f"({predicted} B), measured {format_bytes(measured)} ({measured} B), "
          f"error {100 * (predicted - measured) / measured:+.1f}%")


def _setup(args: argparse.Namespace) -> tuple[Any, tuple[int, ...], Any, int | None]:
    """The model on its device, the sample shape, the device and the budget; ValueError if bad."""
    import torch

    from gradaccum.cli.check import parse_shape
    from gradaccum.core.memory import parse_bytes

    budget = None if args.budget is None else parse_bytes(args.budget)
    if budget is not None and budget > MAX_BUDGET:
        raise ValueError(f"--budget must be at most 1 EiB ({MAX_BUDGET} bytes), got {args.budget!r}")
    try:
        check_probe_sizes(args.probe)
    except ValueError:
        raise ValueError(f"--probe needs two or more different micro-batch sizes, got "
                         f"{' '.join(map(str, args.probe))}") from None
    model, default_shape = load_model(args.model, args.seed)
    shape = default_shape if args.input_shape is None else parse_shape(args.input_shape)
    if shape is None:
        raise ValueError(f"--input-shape is required for model {args.model!r}")
    device = torch.device(check_device(args.device) if args.device else
                          "cuda" if torch.cuda.is_available() else "cpu")
    if budget is None and device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(device)[1])
    if args.check == RECOMMENDED and not (args.global_batch and budget):
        raise ValueError("--check without a size checks the recommendation, which needs "
                         "--global-batch and --budget (or a CUDA device)")
    return model.to(device=device, dtype=getattr(torch, args.dtype)), shape, device, budget


def _sizes(sizes: list[int]) -> str:
    """``2, 4, 8 and 16``."""
    words = list(map(str, sizes))
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _report(args: argparse.Namespace, est: Any, model: Any, shape: tuple[int, ...], device: Any,
            budget: int | None) -> None:
    from gradaccum.core.memory import format_bytes

    n_params = sum(p.numel() for p in model.parameters())
    dropped = sorted(set(args.probe) - set(est.probes))
    probed = _sizes(list(est.probes)) + (f"; {_sizes(dropped)} ran out of memory" if dropped else "")
    print(f"gradaccum plan: {args.model} ({n_params:,} parameters), input "
          f"{'x'.join(map(str, shape))}, {args.optimizer}, {args.dtype}, {device}")
    for label, value, note in (
            ("parameters+buffers", est.param_bytes, ""),
            ("gradients", est.grad_bytes, ""),
            ("optimizer state", est.optimizer_bytes, ""),
            ("activations", est.activation_bytes_per_sample,
             f" per sample (probe windows of 2 micro-batches at {probed})"),
            ("other", est.overhead_bytes, ""),
            ("optimizer step", est.update_peak_bytes, " peak, whatever the micro-batch"),
            ("floor", est.floor, " (micro-batch 1)")):
        print(f"  {label:<18} {format_bytes(value):>10}{note}")
    top = max(args.global_batch or 256, *est.probes)
    print("\n".join(_table(est, [2**i for i in range(top.bit_length())], budget)))


def _run(args: argparse.Namespace) -> int:
    from gradaccum.core.memory import format_bytes
    from gradaccum.torch.memory.probe import estimate_memory

    try:
        model, shape, device, budget = _setup(args)
    except (ValueError, TypeError, ImportError) as error:
        raise UsageError(one_line(error)) from None
    optimizer = _optimizer(args.optimizer, model.parameters())
    try:
        est = estimate_memory(model, optimizer, shape, args.probe)
    except Exception as error:
        if model_raised(error, set()):  # the input shape does not fit the model
            raise UsageError(f"--model {args.model} raised {type(error).__name__} on input shape "
                             f"{'x'.join(map(str, shape))}: {one_line(error)}") from error
        raise
    if budget is not None:
        try:  # a budget below the floor fits no micro-batch: an error, with or without --global-batch
            est.max_micro_batch(budget)
        except ValueError as error:
            raise UsageError(one_line(error)) from None
    _report(args, est, model, shape, device, budget)
    check = None if args.check in (None, RECOMMENDED) else (args.check, args.check_steps)
    if args.global_batch and budget:
        try:
            micro, steps = est.recommend(args.global_batch, budget)
        except ValueError as error:
            raise UsageError(one_line(error)) from None
        print(f"recommended for global batch {args.global_batch} under {format_bytes(budget)}: "
              f"micro-batch {micro} x {steps} steps (predicted peak {format_bytes(est.peak(micro))})")
        check = (micro, steps) if args.check == RECOMMENDED else check
    if check is not None:
        _check(est, model, optimizer, shape, *check)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``plan``."""
    p = sub.add_parser("plan", help="predict memory per micro-batch; recommend micro-batch x steps",
                       description=__doc__)
    p.add_argument("--model", default="bench-cnn",
                   help="a demo model (mlp, cnn, cnn-bn, bench-cnn) or module:factory (default bench-cnn)")
    p.add_argument("--input-shape", default=None,
                   help="one sample's shape, e.g. 3,64,64 (default: the demo model's)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="the parameters' dtype")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--probe", type=positive_int, nargs="+", default=list(DEFAULT_PROBES), metavar="M",
                   help="two or more probe micro-batch sizes; the line is fitted through their "
                   "peaks (default 2 4 8 16)")
    p.add_argument("--global-batch", type=positive_int, default=None,
                   help="the batch to reach (micro-batch x steps) for a recommendation")
    p.add_argument("--budget", default=None,
                   help="memory budget, e.g. 512MiB or 2GB (default on CUDA: the device's memory)")
    p.add_argument("--check", type=positive_int, nargs="?", const=RECOMMENDED, default=None,
                   metavar="M", help="also measure the real peak, at the recommended micro-batch x "
                   "steps (or at micro-batch M), and print it beside the prediction")
    p.add_argument("--check-steps", type=positive_int, default=4,
                   help="micro-batches in a --check M window (default 4)")
    p.add_argument("--seed", type=seed_int, default=0)
    p.set_defaults(func=_run)
