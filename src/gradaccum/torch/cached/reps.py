"""The representations of ``backward_cached``: what ``encode`` returned, checked, gathered, and
their gradient cut back into chunks.

``encode(chunk)`` returns a tensor or a tuple of tensors whose dim 0 indexes the chunk's examples.
The first pass fixes a :class:`Layout` (how many outputs, their dtypes, trailing shapes and rows
per chunk), each output's rows checked against its chunk's examples where the chunk tells them;
the second pass must return the same (a floating output without grad passes no gradient back:
a frozen tower). Each check names the chunk and the output it found wrong. The first pass's
checks raise before any gradient changes; under data parallel the ranks exchange their layouts
first, so that a problem on one rank is raised on all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from gradaccum.torch.distributed.base import GradSync
from gradaccum.torch.distributed.collectives import RankGroups
from gradaccum.torch.memory.split import batch_size

__all__ = ["Layout", "as_outputs", "check_rows", "check_second", "expected_rows", "gradient_slices",
           "representations"]


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

    A floating output may not require grad (every parameter upstream frozen): it then passes no
    gradient back, as in one backward of the whole batch (``CachedBackward`` checks that some
    output does).

    Raises:
        TypeError, ValueError: what :func:`as_outputs` raises; another number of outputs, shape or
            dtype than in the first pass.
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
    return outs


def _leaves(layout: Layout, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.requires_grad_(True) if floating else t
            for t, floating in zip(outputs, layout.floating, strict=True)]


def _share(counts: list[Any], world: int) -> Any:
    """A rank's equal share of the global count: the ranks' sum over the world size."""
    total = sum(counts)
    return total // world if isinstance(total, int) and total % world == 0 else total / world


def expected_rows(chunks: Sequence[Any]) -> list[int | None]:
    """Each chunk's number of examples where the chunk tells it: the common dim 0 of its tensors
    (a tensor, or tuples, lists and dicts of them, as :func:`gradaccum.chunks` cuts; strings and
    numbers in it do not count); None where it does not (a list of texts, an object of the
    user's, tensors of different lengths)."""
    rows: list[int | None] = []
    for chunk in chunks:
        try:
            rows.append(batch_size(chunk))
        except (TypeError, ValueError):
            rows.append(None)
    return rows


def check_rows(layout: Layout, rows: Sequence[int | None]) -> None:
    """Every output of chunk ``i`` has ``rows[i]`` rows (None: not known, not checked).

    Raises:
        ValueError: naming the chunk, the output and both counts.
    """
    for i, (shapes, want) in enumerate(zip(layout.shapes, rows, strict=True)):
        for k, shape in enumerate(shapes):
            if want is not None and shape[0] != want:
                raise ValueError(f"output {k} of encode for chunk {i} has {shape[0]} row(s), its chunk "
                                 f"{want} example(s): dim 0 of each output indexes the chunk's examples "
                                 "(return two views as two outputs; keep a per-batch value such as a "
                                 "temperature inside loss_fn)")


def representations(results: list[Any], n: Any, sync: GradSync, rows: Sequence[int | None]
                    ) -> tuple[Layout, list[torch.Tensor], list[int], Any]:
    """What ``loss_fn`` takes, from what ``encode`` returned for each chunk.

    ``rows``: each chunk's examples where known (:func:`expected_rows`), checked against every
    output's dim 0.

    Returns:
        ``(layout, leaves, own, count)``: the first pass's layout; each output concatenated over
        the chunks (and under data parallel over the ranks, in rank order), a leaf that requires
        grad if floating; each output's offset of this rank's rows in its leaf; the call's count
        (under data parallel, this rank's equal share of the ranks' summed ``n``).

    Raises:
        TypeError, ValueError: a bad output (:func:`as_outputs`, :meth:`Layout.of`,
            :func:`check_rows`); under data parallel on every rank, when any rank's outputs are
            bad or the ranks' differ in kind.
    """
    world = sync.world_size
    layout: Layout | None = None
    problem: Exception | None = None
    try:
        per_chunk = [as_outputs(r, i) for i, r in enumerate(results)]
        layout = Layout.of(results, per_chunk)
        check_rows(layout, rows)
    except (TypeError, ValueError) as e:
        if world == 1:
            raise
        problem = e  # every rank must hear of it, or the others wait in the gather forever
    outputs = [] if layout is None else [torch.cat(column) for column in zip(*per_chunk, strict=True)]
    if world == 1:
        assert layout is not None
        return layout, _leaves(layout, outputs), [0] * len(outputs), n
    assert isinstance(sync, RankGroups)
    mine = (None if problem is None else f"{type(problem).__name__}: {problem}",
            None if layout is None else layout.signature(), [t.shape[0] for t in outputs],
            n.item() if isinstance(n, torch.Tensor) else n)
    ranks = sync.gather_objects(mine)
    for r, (message, *_) in enumerate(ranks):
        if message is not None:
            raise problem if problem is not None else ValueError(f"encode on rank {r}: {message}")
    assert layout is not None
    if any(other[1] != mine[1] for other in ranks) or len({o[3] is None for o in ranks}) > 1:
        raise ValueError("the ranks' encode outputs (or n_items) differ in number, dtype or shape per "
                         f"example: {[(o[1], o[3]) for o in ranks]}; every rank must give the same kind")
    gathered = [sync.gather_rows(t, [o[2][k] for o in ranks]) for k, t in enumerate(outputs)]
    own = [sum(o[2][k] for o in ranks[:sync.rank]) for k in range(len(outputs))]
    return layout, _leaves(layout, gathered), own, None if n is None else _share([o[3] for o in ranks], world)


def gradient_slices(layout: Layout, leaves: list[torch.Tensor], own: list[int], world: int
                    ) -> list[list[Any]]:
    """``slices[i]``: per floating output, chunk ``i``'s part of this rank's gradient (None where
    ``loss_fn`` did not use the output), times ``world`` under data parallel (every rank computes
    the global loss; DDP/FSDP2 average the ranks' encoder gradients, whose sum is the true one).

    Raises:
        ValueError: ``loss_fn`` used no floating output (no gradient reaches the encoder).
    """
    columns: list[list[Any]] = []
    for k, (leaf, floating) in enumerate(zip(leaves, layout.floating, strict=True)):
        if not floating:
            continue
        rows = layout.rows(k)
        if leaf.grad is None:
            columns.append([None] * len(rows))
            continue
        grad = leaf.grad.narrow(0, own[k], sum(rows))
        columns.append(list(torch.split(grad * world if world > 1 else grad, rows)))
    if all(g is None for column in columns for g in column):
        raise ValueError("loss_fn's result does not depend on any floating output of encode: there is "
                         "no gradient to send back through the encoder")
    return [list(row) for row in zip(*columns, strict=True)]
