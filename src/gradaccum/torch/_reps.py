"""The representations of ``backward_cached``: what ``encode`` returned, checked, chunk by chunk.

``encode(chunk)`` returns a tensor or a tuple of tensors whose dim 0 indexes the chunk's examples.
The first pass fixes a :class:`Layout` (how many outputs, their dtypes, trailing shapes and rows
per chunk); the second pass must return the same, with grad on every floating output. Each check
names the chunk and the output it found wrong, and raises before any gradient changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["Layout", "as_outputs", "check_second"]


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def as_outputs(value: Any, chunk: int) -> tuple[torch.Tensor, ...]:
    """``encode``'s result as a tuple of tensors, each with a batch dimension.

    Raises:
        TypeError: not a tensor, or a tuple/list holding something else.
        ValueError: an empty tuple, or a 0-dim output (no batch dimension).
    """
    outs = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not outs:
        raise ValueError(f"encode returned an empty {type(value).__name__} for chunk {chunk}: it must "
                         "return a tensor or a tuple of tensors")
    for k, out in enumerate(outs):
        if not isinstance(out, torch.Tensor):
            where = "" if outs[0] is value else f" as output {k}"
            raise TypeError(f"encode must return a tensor or a tuple of tensors; for chunk {chunk} it "
                            f"returned a {type(out).__name__}{where}")
        if out.dim() == 0:
            raise ValueError(f"output {k} of encode for chunk {chunk} has no batch dimension (shape ()): "
                             "each output's dim 0 indexes the chunk's examples (keep a per-batch "
                             "scalar such as a temperature inside loss_fn)")
    return outs


class Layout(NamedTuple):
    """What the first pass returned, per output ``k`` and chunk ``i``.

    Attributes:
        single: ``encode`` returned one tensor, not a tuple.
        dtypes: each output's dtype.
        trailing: each output's shape after dim 0.
        shapes: ``shapes[i][k]``, the full shape of output ``k`` of chunk ``i``.
    """

    single: bool
    dtypes: tuple[torch.dtype, ...]
    trailing: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[tuple[int, ...], ...], ...]

    @classmethod
    def of(cls, results: Sequence[Any], outputs: Sequence[tuple[torch.Tensor, ...]]) -> Layout:
        """The layout of the first pass (``results``: what encode returned, ``outputs``: as tuples).

        Raises:
            ValueError: the chunks disagree on the number of outputs, or an output's dtype or
                trailing shape changes from one chunk to the next.
        """
        head = outputs[0]
        for i, outs in enumerate(outputs):
            if len(outs) != len(head):
                raise ValueError(f"encode returned {len(head)} output(s) for chunk 0 and {len(outs)} for "
                                 f"chunk {i}: every chunk must give the same outputs")
            for k, (a, b) in enumerate(zip(head, outs, strict=True)):
                if a.dtype != b.dtype or a.shape[1:] != b.shape[1:] or a.device != b.device:
                    raise ValueError(f"output {k} of encode is {a.dtype} {_shape(a)[1:]} on {a.device} "
                                     f"per example in chunk 0 but {b.dtype} {_shape(b)[1:]} on "
                                     f"{b.device} in chunk {i}: the chunks' outputs are concatenated")
        single = not isinstance(results[0], (tuple, list))
        return cls(single, tuple(t.dtype for t in head), tuple(_shape(t)[1:] for t in head),
                   tuple(tuple(_shape(t) for t in outs) for outs in outputs))

    @property
    def floating(self) -> tuple[bool, ...]:
        """For each output, whether it carries a gradient (floating point)."""
        return tuple(d.is_floating_point for d in self.dtypes)

    def rows(self, k: int) -> list[int]:
        """Output ``k``'s rows in each chunk."""
        return [shapes[k][0] for shapes in self.shapes]

    def signature(self) -> tuple[Any, ...]:
        """What every rank must agree on to be gathered (rows may differ): outputs, dtypes, shapes."""
        return self.single, tuple(map(str, self.dtypes)), self.trailing


def check_second(layout: Layout, chunk: int, value: Any) -> tuple[torch.Tensor, ...]:
    """The second pass's outputs of ``chunk``, checked against the first pass's.

    Raises:
        TypeError, ValueError: what :func:`as_outputs` raises; another number of outputs, shape or
            dtype than in the first pass; a floating output that does not require grad.
    """
    outs = as_outputs(value, chunk)
    want = layout.shapes[chunk]
    if len(outs) != len(want):
        raise ValueError(f"encode returned {len(want)} output(s) for chunk {chunk} in the first pass and "
                         f"{len(outs)} in the second: it must give the same outputs twice")
    for k, (out, shape, dtype) in enumerate(zip(outs, want, layout.dtypes, strict=True)):
        if _shape(out) != shape or out.dtype != dtype:
            raise ValueError(f"output {k} of encode for chunk {chunk} is {out.dtype} {_shape(out)} in the "
                             f"second pass, {dtype} {shape} in the first: encode must give the same "
                             "outputs twice (the second pass replays the RNG state)")
        if dtype.is_floating_point and not out.requires_grad:
            raise ValueError(f"output {k} of encode for chunk {chunk} does not require grad in the second "
                             "pass: encode detached it or ran it under torch.no_grad() (floating outputs "
                             "carry the gradient; return labels as integer tensors)")
    return outs
