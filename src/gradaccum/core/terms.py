"""Loss terms with a window total of their own (``mb.term(loss, n_items, total=T)``): their record
in the window, and the check that each ``total=`` is the term's items over the whole window.

A term weighs ``n / T`` in the window's gradient, so ``T`` must be the sum of the term's counts
over every micro-batch of the window and, under data parallelism, every rank. A total summed over
one rank's micro-batches only (the commonest slip on several ranks) makes the gradient ``W``
times too large with no other sign. The window therefore records, for each term *slot* (the
k-th ``mb.term`` call of a block), the first total given, the sum of the counts and how far the
later blocks' totals strayed from the first; at the boundary the backend sums these over the
ranks (inside the window's one small all-reduce) and :func:`check_term_totals` compares them,
on values every rank shares, so every rank raises the same error or none does.

The values may be plain numbers or framework scalars; only :func:`check_term_totals` reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ["TermSlot", "add_terms", "check_term_totals", "term_sums"]

# Relative tolerance of the comparison: counts are integers or weights summed in float64.
_RTOL = 1e-9


class TermSlot(NamedTuple):
    """One term slot's record over a window (this rank's blocks).

    Attributes:
        total: the ``total=`` of the slot's first block.
        items: the sum of the slot's counts, or ``None`` when a block gave none (a summed term
            may omit ``n_items``: then its total cannot be checked).
        stray: ``sum(|total_b - total|)`` over the later blocks ``b`` (0 when every block gave
            the same total).
        blocks: the blocks that fed this slot.
    """

    total: Any
    items: Any
    stray: Any = 0
    blocks: int = 1


def add_terms(slots: tuple[TermSlot, ...], fed: Sequence[tuple[Any, Any]]) -> tuple[TermSlot, ...]:
    """The window's slots after one block that fed the terms ``fed``, each ``(n_items, total)``
    in call order (``n_items`` None when not given).

    Example:
        >>> s = add_terms((), [(3, 10), (None, 4)])
        >>> s = add_terms(s, [(7, 10), (2, 4)])
        >>> s[0].items, s[0].blocks, s[1].items
        (10, 2, None)
    """
    out = list(slots)
    for i, (n, total) in enumerate(fed):
        if i == len(out):
            out.append(TermSlot(total, n))
            continue
        slot = out[i]
        items = None if slot.items is None or n is None else slot.items + n
        out[i] = TermSlot(slot.total, items, slot.stray + abs(total - slot.total), slot.blocks + 1)
    return tuple(out)


def term_sums(slots: Sequence[TermSlot]) -> list[Any]:
    """The values the ranks sum for :func:`check_term_totals`: per slot ``items`` (0 when
    unknown), ``total``, ``total**2`` (the spread of the totals over the ranks) and ``stray``."""
    out: list[Any] = []
    for s in slots:
        out += [0 if s.items is None else s.items, s.total, s.total * s.total, s.stray]
    return out


def check_term_totals(slots: Sequence[TermSlot], summed: Sequence[Any], world_size: int) -> None:
    """Raise unless each slot's counts, summed over the window's micro-batches and the ranks, come
    to its ``total=``.

    Args:
        slots: this rank's slots.
        summed: :func:`term_sums` of every rank, summed over the ranks (this rank's own on one
            process).
        world_size: the ranks summed over.

    Raises:
        ValueError: a slot whose total strays between blocks or ranks, or whose counts sum to
            another value than its total (the same message on every rank).

    Example:
        >>> check_term_totals(add_terms((), [(4, 8)]), [4, 8, 64, 0], 1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: mb.term #0 of this window was given total=8 but its n_items sum to 4 ...
    """
    for i, slot in enumerate(slots):
        items, total_sum, square_sum, stray = (float(v) for v in summed[4 * i: 4 * i + 4])
        total = total_sum / world_size
        spread = max(square_sum / world_size - total * total, 0.0)  # the totals' variance over ranks
        if stray > _RTOL * total or spread > _RTOL * total * total:
            raise ValueError(
                f"mb.term #{i} of this window was given different totals (from one micro-batch or "
                f"rank to another; {total:g} on average): total= is the term's items over the whole "
                "window, the same value in every micro-batch and on every rank")
        if slot.items is None:
            continue
        if abs(items - total) > _RTOL * max(total, 1.0):
            hint = (f" (a total over this rank's micro-batches only? sum it over the {world_size} "
                    "ranks too, e.g. with torch.distributed.all_reduce)" if world_size > 1 else "")
            raise ValueError(
                f"mb.term #{i} of this window was given total={total:g} but its n_items sum to "
                f"{items:g} over the window's {slot.blocks} micro-batch(es) on {world_size} rank(s): "
                "total= must count the term's items over the whole window (every micro-batch and "
                f"every rank){hint}")
