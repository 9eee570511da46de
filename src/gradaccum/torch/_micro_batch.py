"""The handle of a micro-batch fed by several backward calls (multi-task losses), and of loss
terms with a normalizer of their own (:mod:`gradaccum.torch._terms`).

:func:`feed_block` is ``Accumulator.micro_batch``'s block: it weighs the micro-batch against the
window record it is given, runs each backward through the precision part, and hands the window
after the block to the accumulator's ``commit``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gradaccum.core.terms import add_terms
from gradaccum.core.window import Window
from gradaccum.torch._guards import Guard
from gradaccum.torch._hooks import Feed
from gradaccum.torch._precision import Precision
from gradaccum.torch._terms import term_count, term_factor
from gradaccum.torch._validate import check_loss, check_total
from gradaccum.torch._weights import loss_seed, window_term
from gradaccum.torch.distributed.base import GradSync

__all__ = ["MicroBatch", "feed_block"]


class MicroBatch:
    """One micro-batch fed by several backward calls; see ``Accumulator.micro_batch``.

    Args:
        backward: runs one loss's backward with the micro-batch's weight and returns its
            ``(loss, weight)`` part of the window's loss.
        weigh: ``(n_items, total, reduction)`` to the factor :meth:`term` multiplies a term by
            (validated; raises for a bad value or a block that cannot hold terms).

    Attributes:
        parts: the ``(loss, weight)`` part of the window's loss of each backward so far.
        stepped: after the block, True when the micro-batch completed a window that stepped.
        closed: True once the ``with`` block has ended (``backward`` then raises).
    """

    def __init__(self, backward: Callable[[torch.Tensor], tuple[torch.Tensor, Any]],
                 weigh: Callable[[Any, Any, Any], Any]) -> None:
        self._backward = backward
        self._weigh = weigh
        self.parts: list[tuple[torch.Tensor, Any]] = []
        self.stepped = False
        self.closed = False

    def backward(self, loss: torch.Tensor) -> None:
        """Backward one task's loss (reduced like the block's ``reduction``) right away.

        Raises:
            RuntimeError: the ``with`` block of this micro-batch has ended.
            TypeError, ValueError: a bad ``loss``.
        """
        self._check_open()
        check_loss(loss)
        self.parts.append(self._backward(loss))

    def term(self, loss: torch.Tensor, n_items: Any = None, *, total: Any,
             reduction: str = "mean") -> torch.Tensor:
        """A loss term with a normalizer of its own, weighted for :meth:`backward`.

        Returns ``loss`` times a factor such that, backwarded in this block (alone or summed
        with other terms and plain losses of the same forward: one backward), it weighs exactly
        ``n_items / total`` in the window's gradient (``1 / total`` for a summed loss), whatever
        the other terms' normalizers. Only in a block opened without ``n_items``, whose plain
        losses weigh ``1 / N`` (a mean over the window's micro-batches); and the window must run
        full (:meth:`Accumulator.flush` of a partial one holding a term is refused).

        Args:
            loss: the term's loss over this micro-batch: the mean over its ``n_items`` items
                (``reduction="mean"``) or their sum (``"sum"``).
            n_items: the term's items in this micro-batch: an int, a float or a 0-dim tensor,
                > 0 with ``"mean"`` (>= 0, and optional, with ``"sum"``).
            total: the term's items over the whole window, every micro-batch and rank: a
                number > 0 or a 0-dim tensor (RL knows it: the buffered generation batch).
            reduction: ``"mean"`` or ``"sum"``.

        Raises:
            RuntimeError: the ``with`` block of this micro-batch has ended.
            TypeError, ValueError: a bad ``loss``, ``n_items``, ``total`` or ``reduction``, or a
                block opened with ``n_items``; raised before anything changes.

        Example:
            >>> import gradaccum
            >>> model = torch.nn.Linear(3, 1)
            >>> acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
            >>> x = torch.randn(5, 3)  # 5 items: 3 in the first micro-batch, 2 in the second
            >>> for xb in x.split(3):
            ...     with acc.micro_batch() as mb:
            ...         out = model(xb)
            ...         mb.backward(mb.term(out.pow(2).mean(), len(xb), total=5) + out.mean().abs())
            >>> acc.optimizer_steps
            1
        """
        self._check_open()
        check_loss(loss)
        factor = self._weigh(n_items, total, reduction)
        if isinstance(factor, torch.Tensor):
            factor = factor.to(loss.dtype)
        weighted: torch.Tensor = loss * factor
        return weighted

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this micro-batch's with-block has ended: open a new one with "
                               "acc.micro_batch()")


@contextmanager
def feed_block(window: Window, n: Any, summed: bool, precision: Precision, sync: GradSync, guard: Guard,
               commit: Callable[[Window], bool], before: Callable[[Feed], None] = lambda feed: None
               ) -> Iterator[MicroBatch]:
    """One micro-batch of ``window`` fed by the block's ``mb.backward`` calls.

    The micro-batch is weighed when the block opens (its count ``n``, checked; ``summed``: the
    losses are sum-reduced), and each loss is backpropagated from its weight through
    ``precision``. When the block ends the :class:`MicroBatch` closes (also on error); without an
    error, ``guard`` is told of the backward passes run and ``commit(window after the block)``
    (the accumulator's) returns whether the window stepped (:attr:`MicroBatch.stepped`);
    ``before(feed)`` runs before each backward (the accumulator's feed hooks).
    """
    term, scale = window_term(window, n, precision.overflow_prone, sync)
    pending = window.advance(term, scale=scale, summed=summed)
    check_total(pending.items)

    def run(loss: torch.Tensor) -> tuple[torch.Tensor, Any]:
        seed = loss_seed(loss, n, pending.scale, pending.size, summed)
        before(Feed(window.micro_step, n, "sum" if summed else "mean", seed))
        precision.backward(loss, seed)
        return loss.detach(), 1 if n is None or summed else n

    fed: list[tuple[Any, Any]] = []  # (n_items, total) of each term, in call order

    def weigh(n_term: Any, total: Any, term_reduction: Any) -> Any:
        factor = term_factor(n_term, total, term_reduction, n, sync.world_size, pending.size)
        fed.append((term_count(n_term), term_count(total)))
        return factor

    mb = MicroBatch(run, weigh)
    try:
        yield mb
    finally:
        mb.closed = True
    guard.note_passes(len(mb.parts))
    mb.stepped = commit(pending._replace(losses=pending.losses + tuple(mb.parts),
                                         terms=add_terms(pending.terms, fed)))
