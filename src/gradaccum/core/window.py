"""The accumulation window: micro-step counting, item totals, boundaries, normalization factors.

A *window* is the run of micro-batches whose gradients add up to one optimizer update. This
module holds its arithmetic as a small immutable record, free of any framework, so that every
backend (PyTorch, MindSpore) applies the same rules:

* **mean weighting** (no ``n_items``): the window's gradient is the mean of its micro-batch
  gradients. The size ``N`` is known when the window opens, so each micro-batch loss is scaled by
  ``1/N`` up front and a full window needs no pass over the gradients. A window flushed after
  ``r < N`` micro-batches is corrected by ``N/r``: it is the mean over ``r``, not divided by ``N``.
* **item weighting** (``n_items`` on every micro-batch): the window's gradient is the gradient of
  ``sum(n_i * loss_i) / sum(n_i)``. The total is unknown until the boundary, so each loss is
  scaled by ``n_i / P`` against a *provisional* total ``P`` fixed by the window's first
  micro-batch (its count times ``N``, or, across ranks, the previous window's total), which keeps
  the gradients at the scale of a mean (no fp16 overflow from multiplying by a token count), and
  the gradients are corrected once, at the boundary, by ``P / sum(n_i)``: exactly 1, and no pass,
  for a full window of equal counts. A sum-reduced loss (``reduction="sum"``) is already
  ``n_i * loss_i``: it is scaled by ``1 / P``, and its count may be 0.

Totals may be plain ints or framework scalars (a device tensor of token counts): the record only
adds and divides them, so no value is read back to the host on a micro-step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gradaccum.core.validate import check_positive_int

__all__ = ["Weighting", "Window", "is_one"]

Weighting = Literal["mean", "items"]


def is_one(factor: Any) -> bool:
    """True when ``factor`` is the plain number 1: multiplying by it can be skipped.

    A framework scalar is never "one" here: reading its value would synchronize a device.

    Example:
        >>> is_one(1.0), is_one(2), is_one(True)
        (True, False, False)
    """
    return isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor == 1


@dataclass(frozen=True)
class Window:
    """State of one accumulation window.

    Attributes:
        size: micro-batches that complete the window (``N``).
        micro_step: micro-batches fed so far (0 when the window is empty).
        weighting: ``"mean"`` or ``"items"``, fixed by the window's first micro-batch; ``None``
            while the window is empty.
        items: running total of ``n_items`` (item weighting only); a number or a framework scalar.
        scale: the provisional item total ``P`` the losses are scaled against (item weighting;
            ``None``: losses are multiplied by ``n_items`` and divided by the total at the end).
        summed: a sum-reduced micro-batch was fed, so the total may be 0 (no update then).

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

    @classmethod
    def open(cls, size: int) -> Window:
        """An empty window of ``size`` micro-batches.

        Raises:
            TypeError, ValueError: ``size`` is not an integer >= 1 (the message names ``steps``).
        """
        return cls(check_positive_int("steps", size))

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

    def loss_factor(self, n_items: Any, *, summed: bool = False) -> Any:
        """Factor applied to a micro-batch's loss before its backward.

        Args:
            n_items: the micro-batch's count (``None`` under mean weighting).
            summed: the loss is a sum over the micro-batch's items, not a mean.

        Returns:
            ``1/size`` under mean weighting; under item weighting ``n_items / scale`` (a mean
            loss) or ``1 / scale`` (a summed one), with ``scale`` taken as 1 when unset.
        """
        if n_items is None:
            return 1.0 / self.size
        if self.scale is None:
            return 1 if summed else n_items
        return 1.0 / self.scale if summed else n_items / self.scale

    def advance(self, n_items: Any, *, scale: Any = None, summed: bool = False) -> Window:
        """Return the window after one more micro-batch (validated by :meth:`weighting_for`).

        Args:
            n_items: the micro-batch's count, or ``None``.
            scale: the provisional total, taken only from the window's first micro-batch.
            summed: the micro-batch's loss is sum-reduced.
        """
        weighting = self.weighting_for(n_items)
        items = self.items if n_items is None else self.items + n_items
        # A plain constructor call (no validation, no dataclasses.replace): this runs on every
        # micro-step.
        return Window(self.size, self.micro_step + 1, weighting, items,
                      self.scale if self.micro_step else scale, self.summed or summed)

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
        return 1.0 / total if self.scale is None else self.scale / total

    def resized(self, size: int) -> Window:
        """Return this window with another size; only an empty window may change size.

        The same size leaves the window as it is (micro-batches included).

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
        return Window.open(size)
