"""The accumulation window as one immutable record, and all of its arithmetic.

A *window* is the run of micro-batches whose gradients add up to one optimizer update. Its state
is one :class:`Window` (after optax's ``MultiStepsState``): the accumulator holds this record and
the gradients, and a checkpoint is this record plus the gradients. Every backend applies the rules
below through this module; none keeps a second copy of them.

* **mean weighting** (no ``n_items``): the window's gradient is the mean of its micro-batch
  gradients. ``N`` is known when the window opens, so each micro-batch's backward is weighted by
  ``1/N`` and a full window needs no pass over the gradients. A window flushed after ``r < N``
  micro-batches is corrected by ``N/r``: the mean over ``r``, not a division by ``N``.
* **item weighting** (``n_items`` on every micro-batch): the window's gradient is the gradient of
  ``sum(n_i * loss_i) / sum(n_i)``. The total is unknown until the boundary, so each backward is
  weighted by ``n_i / P`` against a *provisional total* ``P`` (:func:`provisional_total`), and the
  gradients are corrected once, at the boundary, by ``P / sum(n_i)``. A sum-reduced loss
  (``reduction="sum"``) already is ``n_i * loss_i``: it is weighted by ``1 / P`` and its count
  may be 0.

**The provisional total, written once.** ``P = N * c``, where ``c`` is a count per micro-batch:
the window's first micro-batch's count for the run's first window (across ranks, the largest of
the ranks' first counts, agreed once), and afterwards the previous window's mean count per
micro-batch (across ranks, of every rank's items: the same value everywhere, with no extra
collective). Why: ``P`` only sets the scale of the backward passes, since the boundary's
correction ``P / sum(n_i)`` cancels it exactly. ``P ~ N * c`` keeps every ``n_i / P`` near
``1/N``, the scale of a plain mean (multiplying by a token count instead overflows fp16 under a
GradScaler); a full window of equal Python counts gets ``P == sum(n_i)`` and a correction of
exactly 1, so no pass. A backend may round a framework scalar ``P`` to a power of two (the torch
adapter does), so that ``n_i / P`` carries ``n_i``'s bits unchanged.

Totals may be plain numbers or framework scalars (a device tensor of token counts): the record
only adds, multiplies and divides them, so no value is read back to the host on a micro-step.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from gradaccum.core.validate import check_positive_int

__all__ = ["Weighting", "Window", "is_one", "provisional_total"]

Weighting = Literal["mean", "items"]


def is_one(factor: Any) -> bool:
    """True when ``factor`` is the plain number 1: multiplying by it can be skipped.

    A framework scalar is never "one" here: reading its value would synchronize a device.

    Example:
        >>> is_one(1.0), is_one(2), is_one(True)
        (True, False, False)
    """
    return isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor == 1


def provisional_total(count: Any, size: int) -> Any:
    """The provisional item total ``P = size * count`` of a window (the rule: module docstring).

    ``count`` is the first micro-batch's count or the previous window's mean count per
    micro-batch; a count of 0 (a window of summed losses with no items) counts as 1, so that
    ``P`` is never 0. A framework scalar is multiplied as it is (the backend keeps it >= 1).

    Example:
        >>> provisional_total(3, 4), provisional_total(0, 4), provisional_total(2.5, 2)
        (12, 4, 5.0)
    """
    if isinstance(count, (int, float)) and count <= 0:
        count = 1
    return size * count


class Window(NamedTuple):
    """One accumulation window, an immutable record: each micro-batch gives a new one.

    Attributes:
        size: micro-batches that complete the window (``N``).
        micro_step: micro-batches fed so far (0 when the window is empty).
        weighting: ``"mean"`` or ``"items"``, fixed by the window's first micro-batch; ``None``
            while the window is empty.
        items: the running item total ``sum(n_i)`` (item weighting); a number or framework scalar.
        scale: the provisional total ``P`` (item weighting), fixed by the first micro-batch.
        summed: a sum-reduced micro-batch was fed, so the total may be 0 (no update then).
        basis: the count per micro-batch the next ``P`` derives from (carried over from the
            previous window; ``None`` before the first item-weighted window).
        losses: ``(loss, weight)`` for each backward: the window's loss is
            ``sum(loss * weight) / denominator`` (:meth:`loss_denominator`).
        terms: the record of the window's terms of their own total (``mb.term``), one
            :class:`gradaccum.core.terms.TermSlot` per slot; a window holding one runs full.
        opened_at: the count (optimizer steps, or the epoch of an epoch schedule) at which the
            schedule gave ``size``; ``None`` when ``size`` came from elsewhere (a resize). A
            window keeps its size to its boundary, whatever the schedule gives later.

    Example:
        >>> w = Window.open(2)
        >>> w.loss_factor(None)
        0.5
        >>> w = w.advance(None)
        >>> w.complete, w.grad_factor()
        (False, 2.0)
        >>> w.advance(None).grad_factor()
        1.0
    """

    size: int
    micro_step: int = 0
    weighting: Weighting | None = None
    items: Any = 0
    scale: Any = None
    summed: bool = False
    basis: Any = None
    losses: tuple[tuple[Any, Any], ...] = ()
    terms: tuple[Any, ...] = ()
    opened_at: int | None = None

    @classmethod
    def open(cls, size: int, basis: Any = None, opened_at: int | None = None) -> Window:
        """An empty window of ``size`` micro-batches, carrying ``basis`` from the last one;
        ``opened_at`` is the count the schedule gave ``size`` at (:attr:`opened_at`).

        Raises:
            TypeError, ValueError: ``size`` is not an integer >= 1 (the message names ``steps``).
        """
        return cls(check_positive_int("steps", size), basis=basis, opened_at=opened_at)

    @property
    def empty(self) -> bool:
        """True when no micro-batch has been fed to this window."""
        return self.micro_step == 0

    @property
    def complete(self) -> bool:
        """True when the window holds ``size`` micro-batches: the optimizer steps now."""
        return self.micro_step >= self.size

    @property
    def next_is_last(self) -> bool:
        """True when the *next* micro-batch completes the window (sync its backward)."""
        return self.micro_step + 1 >= self.size

    def weighting_for(self, n_items: Any) -> Weighting:
        """Return the weighting a micro-batch with ``n_items`` implies for this window.

        Raises:
            ValueError: the window already holds micro-batches of the other form (one window
                cannot mix mean and item weighting: the result would have no meaning).
        """
        wanted: Weighting = "mean" if n_items is None else "items"
        if self.weighting is not None and wanted != self.weighting:
            raise ValueError(
                f"n_items={n_items!r} mixes weightings inside one window: its first "
                f"{self.micro_step} micro-batch(es) used "
                f"{'no n_items' if self.weighting == 'mean' else 'n_items'}; pass n_items on "
                "every micro-batch of a window or on none"
            )
        return wanted

    def first_count(self, n_items: Any) -> Any:
        """The count the window's ``P`` derives from, were ``n_items`` its first micro-batch's."""
        return n_items if self.basis is None else self.basis

    def loss_factor(self, n_items: Any, *, summed: bool = False) -> Any:
        """The weight of a micro-batch's backward (its loss's gradient seed).

        Args:
            n_items: the micro-batch's count (``None`` under mean weighting).
            summed: the loss is a sum over the micro-batch's items, not a mean.

        Returns:
            ``1/size`` under mean weighting; under item weighting ``n_items / scale`` (a mean
            loss) or ``1 / scale`` (a summed one), ``scale`` taken as 1 when unset.
        """
        if n_items is None:
            return 1.0 / self.size
        if self.scale is None:
            return 1 if summed else n_items
        return 1.0 / self.scale if summed else n_items / self.scale

    def advance(self, n_items: Any, *, scale: Any = None, summed: bool = False,
                losses: tuple[tuple[Any, Any], ...] = ()) -> Window:
        """Return the window after one more micro-batch (validated by :meth:`weighting_for`).

        Args:
            n_items: the micro-batch's count, or ``None``.
            scale: the provisional total, taken only from the window's first micro-batch.
            summed: the micro-batch's loss is sum-reduced.
            losses: its ``(loss, weight)`` parts, appended to :attr:`losses`.
        """
        weighting: Weighting = "mean" if n_items is None else "items"
        if self.weighting is not None and weighting != self.weighting:
            self.weighting_for(n_items)  # raises, naming the mix
        items = self.items if n_items is None else n_items if not self.micro_step else self.items + n_items
        # A plain constructor call (no validation, no _replace): this runs on every micro-step.
        return Window(self.size, self.micro_step + 1, weighting, items,
                      self.scale if self.micro_step else scale, self.summed or summed, self.basis,
                      self.losses + losses, self.terms, self.opened_at)

    def grad_factor(self, items: Any = None) -> Any:
        """Factor that turns the accumulated gradient into the window's gradient.

        Args:
            items: under item weighting, the window's item total (after any cross-rank
                reduction, expressed per rank the way the gradients are); defaults to
                :attr:`items`.

        Returns:
            ``size / micro_step`` under mean weighting (exactly 1.0 for a full window, so no
            pass is needed), ``scale / items`` under item weighting (``1 / items`` without a
            scale).

        Raises:
            ValueError: the window is empty.
        """
        if self.empty:
            raise ValueError("an empty window has no gradient to normalize")
        if self.weighting == "mean":
            return self.size / self.micro_step
        total = self.items if items is None else items
        # ** -1, not 1.0 / total: the same value, and a framework scalar's reflected division is
        # several times slower in torch.
        if self.scale is None:
            return 1.0 / total if isinstance(total, (int, float)) else total ** -1
        return self.scale / total

    def loss_denominator(self, items: Any = None) -> Any:
        """What ``sum(loss * weight)`` over :attr:`losses` is divided by for the window's loss:
        the micro-step count (mean weighting) or the item total (``items`` after a reduction).

        Example:
            >>> Window.open(4).advance(None).advance(None).loss_denominator()
            2
        """
        if self.weighting == "items":
            return self.items if items is None else items
        return self.micro_step

    def next_basis(self, items: Any = None) -> Any:
        """The count per micro-batch the next window's ``P`` derives from: this window's mean
        count (``items`` after a reduction), or the carried basis under mean weighting.

        A Python total that divides evenly stays an int, so equal counts give an exact ``P``.

        Example:
            >>> Window.open(2).advance(4).advance(4).next_basis(), Window.open(2).advance(3).next_basis()
            (4, 3)
        """
        if self.weighting != "items" or self.empty:
            return self.basis
        total = self.items if items is None else items
        if isinstance(total, int) and total % self.micro_step == 0:
            return total // self.micro_step
        return total / self.micro_step

    def resized(self, size: int) -> Window:
        """Return this window with another size; only an empty window may change size.

        The same size leaves the window as it is (micro-batches included); another one makes
        an empty window whose size no count gave (``opened_at`` None).

        Raises:
            ValueError: the window already holds micro-batches (a size change waits for the
                boundary).
        """
        if size == self.size:
            return self
        if not self.empty:
            raise ValueError(
                f"steps can change only at a window boundary: the window holds "
                f"{self.micro_step} of {self.size} micro-batches, new steps={size!r}"
            )
        return Window.open(size, self.basis)
