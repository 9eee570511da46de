"""The batch the equivalence checker runs: positional tensors, keyword arguments, or a drawn one.

A sample is a tensor (``model(x)``), a tuple of tensors (``model(*sample)``), a dict of keyword
arguments (``model(**sample)``, as a Hugging Face model is called), or the shape of one input
sample (a random batch is drawn). Tensors are split along dimension 0; a keyword argument that is
not a tensor (``use_cache=False``) goes unchanged to every call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradaccum.core.validate import check_positive_int

__all__ = ["Batch", "make_batch"]


@dataclass(frozen=True)
class Batch:
    """A batch of inputs: positional and keyword arguments of the model, ``size`` samples each.

    Attributes:
        args: the positional tensors, in order.
        kwargs: the keyword arguments: tensors (split like ``args``) and constants.
        size: the number of samples (the tensors' dimension 0).
    """

    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    size: int = 0

    def part(self, start: int, stop: int) -> Batch:
        """The samples ``start:stop`` (constants kept as they are)."""
        cut = slice(start, stop)
        kwargs = {k: v[cut] if isinstance(v, torch.Tensor) else v for k, v in self.kwargs.items()}
        return Batch(tuple(t[cut] for t in self.args), kwargs, stop - start)

    def run(self, model: nn.Module) -> Any:
        """``model(*args, **kwargs)``."""
        return model(*self.args, **self.kwargs)

    def to(self, device: torch.device) -> Batch:
        """The batch on ``device``."""
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.kwargs.items()}
        return Batch(tuple(t.to(device) for t in self.args), kwargs, self.size)


def make_batch(sample: Any, steps: int, micro_batch: int, dtype: torch.dtype | None,
               device: torch.device, seed: int, vocab: int | None) -> Batch:
    """The checker's batch from ``sample``: a tensor, a tuple of tensors, a dict or a shape.

    Floating tensors are cast to ``dtype`` (``None``: kept); a shape draws ``steps * micro_batch``
    standard-normal samples (int64 token ids in ``[0, vocab)`` with ``vocab``).

    Raises:
        TypeError: ``sample`` is none of these, or a dict with a key that is not a string.
        ValueError: tensors that do not share their first (batch) dimension, or ``vocab`` with a
            sample that is not a shape.

    Example:
        >>> b = make_batch({"x": torch.ones(4, 2), "flag": True}, 2, 8, None, torch.device("cpu"), 0, None)
        >>> b.size, b.part(0, 2).kwargs["x"].shape, b.part(0, 2).kwargs["flag"]
        (4, torch.Size([2, 2]), True)
    """
    is_shape = isinstance(sample, (tuple, list)) and bool(sample) and all(
        isinstance(s, int) and not isinstance(s, bool) for s in sample)
    if vocab is not None:
        check_positive_int("vocab", vocab)
        if not is_shape:
            raise ValueError(f"vocab={vocab} draws token ids for a sample shape; sample is a "
                             f"{type(sample).__name__} (it holds its own token ids)")
    args: list[torch.Tensor] = []
    kwargs: dict[str, Any] = {}
    if isinstance(sample, torch.Tensor):
        args = [sample]
    elif is_shape:
        shape = (steps * check_positive_int("micro_batch", micro_batch), *sample)
        gen = torch.Generator().manual_seed(seed)
        args = [torch.randn(shape, generator=gen) if vocab is None
                else torch.randint(0, vocab, shape, generator=gen)]
    elif isinstance(sample, (tuple, list)) and sample and all(isinstance(s, torch.Tensor) for s in sample):
        args = list(sample)
    elif isinstance(sample, Mapping) and any(isinstance(v, torch.Tensor) for v in sample.values()):
        bad = [k for k in sample if not isinstance(k, str)]
        if bad:
            raise TypeError(f"a dict sample holds keyword arguments: its keys must be strings, "
                            f"got {bad[0]!r}")
        kwargs = dict(sample)
    else:
        raise TypeError(f"sample must be a tensor, a tuple of tensors, a dict of keyword arguments "
                        f"(model(**sample)) or an input shape, got {_short(sample)}")
    tensors = {**{str(i): t for i, t in enumerate(args)},
               **{k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}}
    sizes = {name: t.shape[0] if t.dim() else -1 for name, t in tensors.items()}
    if len(set(sizes.values())) != 1 or -1 in sizes.values():
        raise ValueError(f"sample tensors must share their first (batch) dimension, got shapes "
                         f"{ {k: tuple(t.shape) for k, t in tensors.items()} }")

    def cast(t: torch.Tensor) -> torch.Tensor:
        return (t.to(dtype) if dtype is not None and t.is_floating_point() else t).to(device)

    return Batch(tuple(cast(t) for t in args),
                 {k: cast(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
                 next(iter(sizes.values())))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"a {type(value).__name__}"
