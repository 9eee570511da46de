"""Feeding one micro-batch from more than one graph, as a mixin of the accumulator.

:meth:`micro_batch` (a multi-task block: one backward per task loss, one micro-batch) and
:meth:`backward_cached` (a loss that couples the batch's examples, by representation caching:
torch/cached/backward.py). :class:`~gradaccum.Accumulator` inherits both; each checks its input, opens
the micro-batch with the accumulator's ``_before_feed`` and closes it with its ``_commit``, as
``Accumulator.backward`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gradaccum.core.terms import add_terms
from gradaccum.core.window import Window
from gradaccum.torch._guards import Guard, refuse_entry
from gradaccum.torch._micro_batch import MicroBatch, micro_batch_block
from gradaccum.torch._precision import Precision
from gradaccum.torch._terms import term_count, term_factor
from gradaccum.torch._validate import Items, Reduction, check_items, check_total
from gradaccum.torch._weights import loss_seed, window_term
from gradaccum.torch.cached.backward import CachedBackward
from gradaccum.torch.distributed.base import GradSync

__all__ = ["Feeds", "refuse_partial"]


def refuse_partial(cause: str | None, micro_step: int) -> None:
    """Raise if a ``backward_cached`` call left the window partly accumulated (``cause``: what it
    raised; None: the window is whole).

    Raises:
        RuntimeError: naming ``discard()``, the one way on.
    """
    if cause is not None:
        raise RuntimeError(
            f"this window is partly accumulated: a backward_cached call raised ({cause}) after its "
            f"second pass had added part of its batch's gradient into the gradients of the window's "
            f"{micro_step} earlier micro-batch(es). Call acc.discard() to drop the window (its "
            "gradients are lost); then feed the next batch")


class Feeds:
    """``micro_batch`` and ``backward_cached`` of :class:`~gradaccum.Accumulator` (set in its
    ``__init__``: the attributes below; it defines the two methods that open and close a feed)."""

    _window: Window
    _precision: Precision
    _sync: GradSync
    _guard: Guard
    _cached: CachedBackward
    _partial: str | None  # what the backward_cached call that left the window partly accumulated raised
    _entered: bool

    def _before_feed(self, window: Window) -> None:
        raise NotImplementedError  # Accumulator's

    def _commit(self, window: Window) -> bool:
        raise NotImplementedError  # Accumulator's

    def backward_cached(self, encode: Callable[[Any], Any], loss_fn: Callable[..., torch.Tensor],
                        chunks: Iterable[Any], n_items: Items = None, *, reduction: Reduction = "mean"
                        ) -> bool:
        """Feed one batch whose loss couples its examples (contrastive), at one chunk's memory.

        The whole batch's exact gradient by representation caching, as one micro-batch of the
        window (GradCache: encode each chunk without grad, run ``loss_fn`` once, encode each chunk
        again with its RNG replayed and backpropagate its slice; docs/CONTRASTIVE.md).

        Args:
            encode: ``encode(chunk)`` gives a tensor or tuple of tensors, dim 0 the chunk's examples.
            loss_fn: ``loss_fn(*reps)`` gets each output concatenated over chunks (and ranks) and
                returns the scalar loss; non-floating outputs (labels) carry no grad.
            chunks: the batch's micro-batches, a non-empty iterable (:func:`gradaccum.chunks`).
            n_items: the batch's items (this rank's), as for :meth:`backward`.
            reduction: ``"mean"`` or ``"sum"``: how ``loss_fn`` reduces over the items.

        Returns:
            True when this call completed the window and the optimizer stepped.

        Raises:
            TypeError, ValueError, RuntimeError: bad input (empty ``chunks``; ``encode`` outputs
                not tensors, without dim 0, of other rows than their chunk's examples, or
                changing; a non-scalar loss), and whatever ``encode`` or ``loss_fn`` raise. Before
                the second pass's first backward, or on a window's first micro-batch, gradients,
                window, BatchNorm and RNG are then as they were; later in a window, the window is
                left partly accumulated, and the next feed, ``flush`` or ``state_dict`` raises
                until :meth:`discard` (docs/CONTRASTIVE.md, "Failures").

        Example:
            >>> import gradaccum
            >>> enc = torch.nn.Linear(4, 3)
            >>> acc = gradaccum.Accumulator(torch.optim.SGD(enc.parameters(), lr=0.1), steps=1, model=enc)
            >>> loss_fn = lambda z: torch.nn.functional.cross_entropy(z @ z.T, torch.arange(len(z)))
            >>> acc.backward_cached(enc, loss_fn, gradaccum.chunks(torch.randn(10, 4), 4))
            True
        """
        n = check_items(n_items, reduction)
        if self._entered:
            refuse_entry("backward_cached")
        self._entered = True
        try:
            self._before_feed(self._window)
            try:
                window = self._cached.run(encode, loss_fn, chunks, self._window, n, reduction == "sum")
            except BaseException as e:
                if self._cached.partial:
                    text = str(e)
                    self._partial = f"{type(e).__name__}: {text if len(text) <= 200 else text[:197] + '...'}"
                raise
            self._guard.note_passes(self._cached.passes, self._cached.loss_params)
            return self._commit(window)
        finally:
            self._entered = False

    @contextmanager
    def micro_batch(self, n_items: Items = None, *, reduction: Reduction = "mean") -> Iterator[MicroBatch]:
        """Feed one micro-batch whose loss comes from several forward graphs (multi-task).

        Call ``mb.backward(loss)`` right after each task's forward, so only one autograd graph is
        alive at a time; the block counts as one micro-batch and the handle closes with it. On an
        exception inside the block, call :meth:`discard`: its gradients are partly accumulated.

        Terms of different normalizers (a policy term per sequence, an entropy bonus per token,
        an auxiliary loss per micro-batch): open the block without ``n_items`` and give each
        term its count and its total over the window, ``mb.backward(mb.term(loss, n_items,
        total=T) + ...)`` (:meth:`MicroBatch.term`); a plain loss in the sum weighs ``1/N``, a
        mean over the window's micro-batches. Exact for a full window (one holding a term cannot
        be flushed early: docs/INTEGRATIONS.md).

        Example:
            >>> from gradaccum import Accumulator
            >>> model = torch.nn.Linear(3, 2)
            >>> acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps=1)
            >>> x = torch.randn(4, 3)
            >>> with acc.micro_batch() as mb:
            ...     mb.backward(model(x)[:, 0].pow(2).mean())
            ...     mb.backward(model(x)[:, 1].abs().mean())
            >>> mb.stepped
            True
        """
        n = check_items(n_items, reduction)
        if self._entered:
            refuse_entry("micro_batch")
        self._entered = True
        try:
            with self._micro_batch(n, reduction == "sum") as mb:
                yield mb
        finally:
            self._entered = False

    @contextmanager
    def _micro_batch(self, n: Any, summed: bool) -> Iterator[MicroBatch]:
        """The block of :meth:`micro_batch` (which holds the entry flag around it)."""
        window = self._window
        self._before_feed(window)
        term, scale = window_term(window, n, self._precision.overflow_prone, self._sync)
        pending = window.advance(term, scale=scale, summed=summed)
        check_total(pending.items)

        def run(loss: torch.Tensor) -> tuple[torch.Tensor, Any]:
            self._precision.backward(loss, loss_seed(loss, n, pending.scale, pending.size, summed))
            return loss.detach(), 1 if n is None or summed else n

        fed: list[tuple[Any, Any]] = []  # (n_items, total) of each term, in call order

        def weigh(n_term: Any, total: Any, term_reduction: Any) -> Any:
            factor = term_factor(n_term, total, term_reduction, n, self._sync.world_size, pending.size)
            fed.append((term_count(n_term), term_count(total)))
            return factor

        with micro_batch_block(run, weigh) as mb:
            yield mb
        self._guard.note_passes(len(mb.parts))
        mb.stepped = self._commit(pending._replace(losses=pending.losses + tuple(mb.parts),
                                                   terms=add_terms(pending.terms, fed)))
