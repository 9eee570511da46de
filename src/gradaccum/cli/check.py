"""``gradaccum check``: is accumulation exactly equivalent to the full batch for this model?

Exit code 0 when it is (within the tolerance), 1 when it is not, 2 on a usage error, 3 when the
model itself raised (its factory, forward or backward: e.g. an ``--input-shape`` it cannot take).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from gradaccum.cli._errors import CommandError, ModelError, UsageError, model_raised, one_line
from gradaccum.cli._options import check_count, check_device, finite_float, positive_int, seed_int

__all__ = ["add_parser", "load_factory", "parse_shape"]

DTYPES = ("float64", "float32")
LOSSES = ("mse", "cross-entropy", "token-cross-entropy", "causal-lm")


def load_factory(spec: str) -> tuple[Callable[[], Any], tuple[int, ...] | None]:
    """Resolve ``--model``: a demo model name or an importable ``module:factory``.

    Args:
        spec: ``mlp``, ``cnn``, ``cnn-bn``, ``bench-cnn``, or ``package.module:function`` (a
            callable with no required argument that returns an ``nn.Module``; the current
            directory is importable).

    Returns:
        The factory, and the demo model's input shape (``None`` for a user factory).

    Raises:
        ValueError: neither a demo name nor ``module:factory``, or the attribute is missing.
        ImportError: the module cannot be imported.
        TypeError: the attribute is not callable.

    Example:
        >>> load_factory("mlp")[1]
        (1, 28, 28)
    """
    from gradaccum.demos.models import MODELS

    if spec in MODELS:
        factory, shape = MODELS[spec]
        return factory, shape
    if spec.count(":") != 1:
        raise ValueError(f"--model must be one of {sorted(MODELS)} or 'module:factory', got {spec!r}")
    module_name, attr = spec.split(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: the user's own modules
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--model {spec!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"--model {spec!r} is a {type(obj).__name__}, not a callable factory")
    return obj, None


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse ``--input-shape``: one sample's shape, ``"1,28,28"``.

    Raises:
        ValueError: not comma-separated integers >= 1.

    Example:
        >>> parse_shape("3, 64, 64")
        (3, 64, 64)
    """
    try:
        shape = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise ValueError(f"--input-shape must be integers like 1,28,28, got {text!r}") from None
    if any(n < 1 for n in shape):
        raise ValueError(f"--input-shape must be integers >= 1, got {text!r}")
    check_count(math.prod(shape), f"--input-shape {text!r}: the items per sample")
    return shape


def _load_sample(path: str) -> tuple[Any, Any]:
    """``--sample``: a non-empty tensor, tuple of tensors, dict of keyword arguments, or
    ``{'inputs': ..., 'targets': ...}`` (the inputs any of the former).

    Raises:
        UsageError: the file is missing, not a ``torch.save`` file, or holds no items.
    """
    import torch

    try:
        loaded = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise UsageError(f"--sample {path}: no such file") from None
    except Exception as err:  # a text file, a truncated file...: all one usage error
        raise UsageError(f"--sample {path} is not a torch.save file "
                         f"({type(err).__name__}: {one_line(err)})") from None
    inputs, targets = loaded, None
    if isinstance(loaded, dict) and "inputs" in loaded:
        inputs, targets = loaded["inputs"], loaded.get("targets")
    if isinstance(inputs, torch.Tensor):
        tensors = [inputs]
    elif isinstance(inputs, dict) and all(isinstance(k, str) for k in inputs):
        tensors = [t for t in inputs.values() if isinstance(t, torch.Tensor)]  # keyword arguments
    else:
        tensors = list(inputs) if isinstance(inputs, (tuple, list)) else []
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise UsageError(f"--sample {path} holds {type(loaded).__name__}, not a tensor, a tuple of "
                         "tensors, a dict of keyword arguments or {'inputs': ..., 'targets': ...}")
    if any(t.dim() == 0 or t.shape[0] == 0 or t.numel() == 0 for t in tensors):
        raise UsageError(f"--sample {path} is empty: its inputs have shapes "
                         f"{[tuple(t.shape) for t in tensors]}, with no items to check")
    return inputs, targets


def _sample(args: argparse.Namespace, demo_shape: tuple[int, ...] | None) -> tuple[Any, Any]:
    """The sample (a batch or an input shape) and the targets (or None)."""
    if args.sample is not None:
        if args.vocab is not None:
            raise UsageError("--vocab draws token ids for --input-shape; a --sample holds its own")
        return _load_sample(args.sample)
    if args.input_shape is not None:
        return parse_shape(args.input_shape), None
    if args.vocab is not None:
        raise UsageError("--vocab draws token ids of --input-shape: give --input-shape too")
    if demo_shape is None:
        raise ValueError("give --input-shape or --sample for a model that is not a demo model")
    return demo_shape, None


def _defining_file(factory: Callable[[], Any]) -> set[str]:
    """The file that defines a factory (its code raising is the model raising)."""
    try:
        return {inspect.getfile(factory)}
    except TypeError:
        return set()


def _run(args: argparse.Namespace) -> int:
    import torch

    from gradaccum.torch.check.checker import check_equivalence
    from gradaccum.torch.check.spawn import RankError

    check_device(args.device)
    try:
        factory, demo_shape = load_factory(args.model)
        sample, targets = _sample(args, demo_shape)
    except (ValueError, TypeError, ImportError) as err:
        raise UsageError(one_line(err)) from None
    except UsageError:
        raise
    except Exception as err:  # the user's module raised while it was imported
        raise ModelError(f"importing --model {args.model} raised {type(err).__name__}: "
                         f"{one_line(err)}") from err
    try:
        report = check_equivalence(
            factory, sample, args.steps, micro_batch=args.micro_batch, targets=targets,
            loss=args.loss, dtype=getattr(torch, args.dtype), atol=args.atol, rtol=args.rtol,
            seed=args.seed, device=args.device, label=args.model, vocab=args.vocab,
            world_size=args.world_size,
        )
    except RankError as err:
        if err.error == "timeout":
            raise CommandError(one_line(err)) from err
        raise ModelError(f"the model raised on {one_line(err)}") from err
    except Exception as err:
        if model_raised(err, _defining_file(factory)):
            raise ModelError(f"the model raised {type(err).__name__}: {one_line(err)}") from err
        if isinstance(err, (ValueError, TypeError)):
            raise UsageError(one_line(err)) from err
        raise
    print(report)
    return 0 if report.equivalent else 1


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``check``."""
    p = sub.add_parser(
        "check", help="is accumulation exact for a model? (full batch against N micro-batches)",
        description="Run one SGD step on a full batch and on N micro-batches from the same weights "
                    "and RNG state; compare every parameter and buffer; name the modules that "
                    "break equivalence and the gradaccum fix. Exit code 0: equivalent, 1: not, "
                    "2: usage error, 3: the model itself raised.")
    p.add_argument("--model", required=True,
                   help="a demo model (mlp, cnn, cnn-bn, bench-cnn) or an importable module:factory")
    p.add_argument("--input-shape", help="one sample's shape, e.g. 1,28,28 (random normal inputs; "
                                         "token ids with --vocab)")
    p.add_argument("--vocab", type=positive_int,
                   help="with --input-shape: draw int64 token ids in [0, VOCAB) (a token model)")
    p.add_argument("--sample", help="a torch.save'd batch: a tensor, a tuple of tensors, a dict "
                                    "of keyword arguments (model(**sample), its 'labels' the "
                                    "targets), or {'inputs': ..., 'targets': ...} (token ids and "
                                    "labels for a language model)")
    p.add_argument("--steps", type=positive_int, default=4,
                   help="micro-batches per window, N (default 4)")
    p.add_argument("--micro-batch", type=positive_int, default=8,
                   help="samples per micro-batch (per rank) with --input-shape (default 8)")
    p.add_argument("--loss", choices=LOSSES, default="mse",
                   help="mse, cross-entropy (classes on dimension 1), token-cross-entropy (a "
                        "language model's [..., vocab] logits against token ids, -100 ignored, "
                        "item-weighted) or causal-lm (a causal LM's own output.loss, or its logits "
                        "against the labels shifted by one, item-weighted by count_tokens(labels, "
                        "shift=True)); targets are random unless --sample holds them "
                        "(default mse)")
    p.add_argument("--world-size", type=positive_int, default=1,
                   help="run the micro-batches on this many DDP-wrapped gloo processes on the CPU "
                        "(each its share of the batch) against one process on the full batch; "
                        "the batch must split into world-size x steps micro-batches (default 1)")
    p.add_argument("--dtype", choices=DTYPES, default="float64",
                   help="run in this dtype (default float64: differences stand far above rounding)")
    p.add_argument("--atol", type=finite_float,
                   help="absolute tolerance (default 1e-12 float64, 1e-6 float32)")
    p.add_argument("--rtol", type=finite_float,
                   help="tolerance relative to the largest update (default 1e-9 float64, 1e-4 float32)")
    p.add_argument("--seed", type=seed_int, default=0, help="weights, inputs and RNG state (default 0)")
    p.add_argument("--device", default="cpu", help="where to run (default cpu)")
    p.set_defaults(func=_run)
