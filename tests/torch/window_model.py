"""An independent float64 model of the accumulation window, for the model-based test.

It shares no code with gradaccum: the gradients are the analytic gradients of a linear model's
squared error in numpy, and the window rules are written here from the documented contract
(README "The contract", docs/GUIDE.md), not from ``gradaccum.core.window``:

* mean weighting: the window's gradient is the mean of its micro-batch gradients over the
  micro-batches it holds (a flushed window is the mean over what it holds);
* item weighting: ``sum(w_i * g_i) / sum(n_i)``, with ``w_i = n_i`` for a mean-reduced loss and
  ``1`` for a sum-reduced one; a window whose total is 0 takes no step;
* a term of its own total (``mb.term``) weighs ``n / T`` (mean) or ``1 / T`` (sum), the plain
  losses of its block ``1 / N``;
* at the boundary: clip the global L2 norm (``coef = min(1, c / (norm + 1e-6))``), skip the
  window if a GradScaler found an inf (the scale halves), else step SGD, then the LR scheduler
  (StepLR: halved every 2 optimizer steps); the window size comes from the schedule at the
  window's opening, read with the optimizer steps taken (or, for an epoch schedule, the epoch
  last set), and a window keeps that size to its boundary;
* ``set_epoch`` gives an empty window the new epoch's size at once, a started one keeps its own;
  ``resize_window`` gives an empty window any size, and the next window reads the schedule again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

D_IN, D_OUT = 3, 2
LR = 0.1


@dataclass(frozen=True)
class Piece:
    """One loss of a micro-batch: ``coef * 0.5 * sum((W x + b - y)**2 * mask)`` over its items,
    divided by the item count when ``mean``."""

    seed: int
    k: int
    mask: tuple[float, float] = (1.0, 1.0)
    coef: float = 1.0
    mean: bool = True

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        return rng.standard_normal((self.k, D_IN)), rng.standard_normal((self.k, D_OUT))

    def value_and_grad(self, w: np.ndarray, b: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        x, y = self.data()
        m = np.asarray(self.mask)
        r = (x @ w.T + b - y) * m
        value = self.coef * 0.5 * float(np.sum(r * r))
        gw, gb = self.coef * r.T @ x, self.coef * r.sum(axis=0)
        if self.mean:
            value, gw, gb = value / self.k, gw / self.k, gb / self.k
        return value, gw, gb


@dataclass
class Part:
    """A micro-batch's contribution: ``weight * gradient`` and ``weight * loss`` under item
    weighting (or plain sums of its losses under mean weighting)."""

    gw: np.ndarray
    gb: np.ndarray
    loss: float
    n: float | None  # the item count (None: mean weighting)
    overflow: bool = False


@dataclass
class RefWindow:
    size: int
    parts: list[Part] = field(default_factory=list)
    terms: bool = False  # a full-window-only term block was fed

    @property
    def weighting(self) -> str | None:
        if not self.parts:
            return None
        return "mean" if self.parts[0].n is None else "items"


class Reference:
    """The float64 reference: parameters, counters and the open window.

    Args:
        w, b: initial parameters (copied).
        sizes: the window size as a function of optimizer steps taken (of the epoch when
            ``by="epoch"``).
        clip: the clip norm or None.
        scheduler: halve the LR every 2 optimizer steps.
        scaler_scale: the GradScaler's initial scale, or None without a scaler.
    """

    def __init__(self, w: np.ndarray, b: np.ndarray, sizes, clip: float | None, scheduler: bool,
                 scaler_scale: float | None, by: str = "step") -> None:
        self.w, self.b = w.astype(np.float64).copy(), b.astype(np.float64).copy()
        self.sizes, self.clip, self.scheduler, self.by = sizes, clip, scheduler, by
        self.scale = scaler_scale
        self.optimizer_steps = 0
        self.skipped_windows = 0
        self.epoch = 0
        self.window_loss: float | None = None
        self.window = RefWindow(sizes(0))

    def _next_size(self) -> int:
        return self.sizes(self.epoch if self.by == "epoch" else self.optimizer_steps)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if not self.window.parts:
            self.window = RefWindow(self._next_size())

    def resize(self, size: int) -> None:
        assert not self.window.parts
        self.window = RefWindow(size)

    # -- feeding ---------------------------------------------------------------------------
    def lr(self) -> float:
        return LR * 0.5 ** (self.optimizer_steps // 2) if self.scheduler else LR

    def micro_batch(self, pieces: list[Piece], n: float | None, summed: bool,
                    overflow: bool = False) -> bool:
        """Feed one micro-batch made of ``pieces`` (one backward each); returns 'stepped'."""
        gw, gb, loss = np.zeros((D_OUT, D_IN)), np.zeros(D_OUT), 0.0
        for p in pieces:
            v, a, c = p.value_and_grad(self.w, self.b)
            loss, gw, gb = loss + v, gw + a, gb + c
        if n is None:
            part = Part(gw, gb, loss, None, overflow)
        else:
            weight = 1.0 if summed else float(n)
            part = Part(weight * gw, weight * gb, weight * loss, float(n), overflow)
        return self._add(part)

    def term_block(self, term: Piece, n_term: float, total: float, plain: Piece,
                   summed_term: bool) -> bool:
        """A block without n_items: ``mb.backward(mb.term(term, n_term, total=total) + plain)``."""
        size = self.window.size
        vt, at, ct = term.value_and_grad(self.w, self.b)
        vp, ap, cp = plain.value_and_grad(self.w, self.b)
        weight = (1.0 if summed_term else n_term) / total  # the term's weight in the window
        # Under mean weighting a part is divided by the window's N at the boundary: scale up.
        gw, gb = size * weight * at + ap, size * weight * ct + cp
        factor = (1.0 if summed_term else n_term) * size / total
        self.window.terms = True
        return self._add(Part(gw, gb, factor * vt + vp, None))

    def _add(self, part: Part) -> bool:
        self.window.parts.append(part)
        if len(self.window.parts) >= self.window.size:
            return self._close()
        return False

    # -- boundaries ------------------------------------------------------------------------
    def flush(self) -> bool:
        if not self.window.parts:
            return False
        return self._close()

    def discard(self) -> None:
        self.window = RefWindow(self._next_size())

    def _close(self) -> bool:
        parts = self.window.parts
        if self.window.weighting == "mean":
            denom: float = len(parts)
        else:
            denom = sum(p.n for p in parts)  # type: ignore[misc]
        stepped = False
        if denom > 0:
            self.window_loss = sum(p.loss for p in parts) / denom
            gw = sum(p.gw for p in parts) / denom
            gb = sum(p.gb for p in parts) / denom
            if self.clip is not None:
                norm = float(np.sqrt(np.sum(gw * gw) + np.sum(gb * gb)))
                coef = min(1.0, self.clip / (norm + 1e-6))
                gw, gb = gw * coef, gb * coef
            if any(p.overflow for p in parts):
                self.scale = self.scale * 0.5 if self.scale is not None else None
            else:
                lr = self.lr()
                self.w, self.b = self.w - lr * gw, self.b - lr * gb
                stepped = True
        if stepped:
            self.optimizer_steps += 1
        else:
            self.skipped_windows += 1
        self.window = RefWindow(self._next_size())
        return stepped
