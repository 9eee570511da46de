"""Feeding an Accumulator one global batch at a time, in micro-batches that fit in memory.

One global batch is one window: :class:`AutoBatch` splits it, resizes the accumulator's empty
window to the number of micro-batches and feeds them, so the optimizer steps once per global
batch and, under DDP, only the last micro-batch's backward synchronizes gradients.

With ``micro_batch="auto"``, an out-of-memory error in a micro-batch drops the partial window
(gradients set to None), halves the micro-batch and reruns the whole global batch from its start:
no micro-batch is lost or counted twice, the effective batch never changes, and the result is
the one a clean run at the smaller micro-batch gives. A retry also restores what the failed
attempt changed besides gradients: the RNG state (dropout masks) and BatchNorm running
statistics.

Under DDP the ranks agree before any of them retries: one all-reduce of an OOM flag per window,
placed before the first collective a micro-batch can block in (the last micro-batch's gradient
sync). An OOM in an off-boundary micro-batch is therefore always recovered. The first window at
each micro-batch size syncs no micro-batch at all (its gradients are averaged after the
agreement), so it is recovered wherever it runs out; after that, an OOM inside the last,
synchronizing micro-batch cannot be (other ranks may already wait in its all-reduce) and raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gradaccum.core import check_positive_int, split_sizes
from gradaccum.torch._validate import Reduction
from gradaccum.torch.accumulator import Accumulator
from gradaccum.torch.distributed.base import agree_on_count
from gradaccum.torch.memory.oom import cuda_in_use, is_oom_error, release_memory
from gradaccum.torch.memory.split import batch_size, split_batch

__all__ = ["AutoBatch", "NoMicroBatchFitsError"]

LossFn = Callable[[Any], Any]
log = logging.getLogger(__name__)


class NoMicroBatchFitsError(RuntimeError):
    """Out of memory at micro-batch 1: not even one sample fits."""


class AutoBatch:
    """Split each global batch into micro-batches, feed them as one window, recover from OOM.

    Args:
        accumulator: the :class:`~gradaccum.Accumulator` to feed. Its ``steps`` is replaced, window
            by window, by the number of micro-batches of each global batch (build it with
            ``steps=1``).
        micro_batch: items per micro-batch, or ``"auto"``: start at ``start`` and halve on
            out-of-memory. A fixed size lets every error, OOM included, pass through.
        start: with ``"auto"``, the first micro-batch to try (default: the whole global batch);
            :meth:`gradaccum.MemoryEstimate.recommend` gives a good one.
        grow_every: with ``"auto"``, try twice the micro-batch again after this many global
            batches in a row without OOM (never reaching a size that ran out); ``None``: never.

    Attributes:
        acc: the accumulator fed.
        auto: True with ``micro_batch="auto"``.
        micro_batch: the micro-batch size the next global batch tries (``None`` until the first
            global batch with ``"auto"`` and no ``start``: the whole batch).
        grow_every: as given.
        ooms: out-of-memory errors recovered from so far.
        last_sizes: the micro-batch sizes of the last attempt, e.g. ``[4, 4, 2]``.

    Raises:
        TypeError, ValueError: a bad argument (the message names it).

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps=1)
        >>> auto = AutoBatch(acc, micro_batch=4)
        >>> x, y = torch.randn(10, 3), torch.randn(10, 1)
        >>> auto.step((x, y), lambda mb: torch.nn.functional.mse_loss(model(mb[0]), mb[1]))
        True
        >>> auto.last_sizes, acc.optimizer_steps
        ([4, 4, 2], 1)
    """

    def __init__(self, accumulator: Accumulator, micro_batch: int | str = "auto", *,
                 start: int | None = None, grow_every: int | None = None) -> None:
        if not isinstance(accumulator, Accumulator):
            raise TypeError(f"accumulator must be a gradaccum.Accumulator, got {type(accumulator).__name__}")
        self.auto = micro_batch == "auto"
        if not self.auto:
            micro_batch = check_positive_int("micro_batch", micro_batch)
            if start is not None or grow_every is not None:
                raise ValueError("start and grow_every apply to micro_batch='auto' only, "
                                 f"got micro_batch={micro_batch!r}")
        self.micro_batch: int | None = (micro_batch if isinstance(micro_batch, int)
                                        else None if start is None
                                        else check_positive_int("start", start))
        self.grow_every = None if grow_every is None else check_positive_int("grow_every", grow_every)
        self.acc = accumulator
        self.ooms = 0
        self.last_sizes: list[int] = []
        self._sync = accumulator.grad_sync  # the accumulator's strategy: where the ranks agree
        self._distributed = self._sync.world_size > 1
        self._stats = _running_stats(accumulator.model)
        self._ceiling: int | None = None  # smallest micro-batch that ran out
        self._proven: set[int] = set()  # sizes that completed a window (DDP: sync may go last)
        self._clean_windows = 0
        self._last_oom = ""

    def step(self, batch: Any, loss_fn: LossFn, *, reduction: Reduction = "mean") -> bool:
        """Train on one global batch: one window, one optimizer step.

        Args:
            batch: a tensor, or a tuple/list/dict of tensors sharing dim 0 (under DDP: this
                rank's share; every rank must hold as many items).
            loss_fn: ``loss_fn(micro_batch) -> loss`` (the micro-batch's mean loss), or
                ``-> (loss, n_items)`` to weight by a count of your own (non-padding tokens).
            reduction: ``"mean"``, or ``"sum"`` when ``loss_fn`` returns ``(summed loss,
                n_items)`` (micro-batches of 0 items allowed; see :meth:`Accumulator.backward`).

        Returns:
            True when the optimizer stepped (False: a GradScaler skipped the window).

        Raises:
            NoMicroBatchFitsError: ``"auto"`` ran out of memory at micro-batch 1.
            RuntimeError: under DDP, an OOM inside the last, synchronizing micro-batch.
            ValueError: under DDP, ranks split their batches into different numbers of parts.
            Exception: any other error of ``loss_fn`` or the optimizer, unchanged.
        """
        total = batch_size(batch)
        saved = self._snapshot() if self.auto else None
        while True:
            size = min(total, self._size(total))
            stepped = self._attempt(batch, total, size, loss_fn, reduction)
            if stepped is not None:
                self._succeeded(size, total)
                return stepped
            assert saved is not None  # only "auto" reports an OOM instead of raising it
            self._recover(size, saved)

    def run(self, batches: Iterable[Any], loss_fn: LossFn, *, reduction: Reduction = "mean") -> int:
        """Train on every global batch of ``batches`` (a loader); returns the optimizer steps taken."""
        return sum(self.step(batch, loss_fn, reduction=reduction) for batch in batches)

    # ------------------------------------------------------------------ one attempt
    def _size(self, total: int) -> int:
        return total if self.micro_batch is None else self.micro_batch

    def _attempt(self, batch: Any, total: int, size: int, loss_fn: LossFn,
                 reduction: Reduction) -> bool | None:
        """Feed the global batch at ``size``; None when (all ranks agree that) one ran out."""
        sizes = split_sizes(total, size)
        parts = split_batch(batch, sizes)
        self.last_sizes = sizes
        k = len(sizes)
        # Even parts on one process: mean weighting, the loss scaled by 1/N up front. Otherwise
        # n_items, so a short last part and ranks with other totals are weighted exactly.
        counts: list[Any] = [None] * k if not self._distributed and len(set(sizes)) == 1 else sizes
        agree = self._distributed and self.auto
        # The first window at a size syncs no micro-batch (its gradients are averaged after the
        # agreement), so any of them may run out safely. Later windows sync in the last one.
        probe = agree and size not in self._proven
        self.acc.resize_window(k + 1 if probe else k)
        before = k - 1 if agree and not probe else k  # micro-batches fed before the agreement
        stepped: bool | None = False
        for i in range(before):
            stepped = self._feed(parts[i], counts[i], loss_fn, reduction, recover=True)
            if stepped is None:
                break
        oom = self._agree(stepped is None, k) if agree else stepped is None
        if oom:
            return None
        if probe:
            return self.acc.flush()
        if before < k:
            return self._feed(parts[-1], counts[-1], loss_fn, reduction, recover=False)
        return stepped

    def _feed(self, part: Any, n: Any, loss_fn: LossFn, reduction: Reduction,
              recover: bool) -> bool | None:
        """Run one micro-batch; None on a recoverable OOM (any other error passes through)."""
        body_done = False
        try:
            out = loss_fn(part)
            loss, n = out if isinstance(out, tuple) else (out, n)
            with self.acc.micro_batch(n, reduction=reduction) as mb:
                mb.backward(loss)
                body_done = True  # an error after this is the boundary's (the optimizer step)
            return mb.stepped
        except Exception as error:
            if body_done or not self.auto or not is_oom_error(error):
                raise
            if not recover:
                raise RuntimeError(
                    "out of memory in the last micro-batch of a window under DDP: its backward "
                    "synchronizes gradients and the other ranks may already wait in that "
                    "all-reduce, so it cannot be retried. Start from a smaller micro-batch "
                    "(AutoBatch(start=...), or gradaccum plan)") from error
            self._last_oom = str(error)  # the message only: the traceback holds activations
        return None

    def _agree(self, oom: bool, parts: int) -> bool:
        """True when any rank ran out; every rank reaches this once per attempt."""
        (anyone,), least, most = agree_on_count(self._sync, parts, [oom])
        if most != least:
            self.acc.discard()
            raise ValueError(
                f"the ranks split their global batches into {least} to {most} micro-batches: "
                "give every rank as many items (a DistributedSampler does)")
        return anyone

    # ------------------------------------------------------------------ after an attempt
    def _succeeded(self, size: int, total: int) -> None:
        self._proven.add(size)
        if self.micro_batch is None:
            self.micro_batch = size
        if self.grow_every is None:
            return
        self._clean_windows += 1
        if self._clean_windows < self.grow_every:
            return
        self._clean_windows = 0
        cap = total if self._ceiling is None else min(total, self._ceiling - 1)
        if min(2 * self.micro_batch, cap) > self.micro_batch:
            self.micro_batch = min(2 * self.micro_batch, cap)
            log.info("no OOM for %d global batches: trying micro-batch %d", self.grow_every,
                     self.micro_batch)

    def _recover(self, size: int, saved: _Saved) -> None:
        """Drop the failed attempt (gradients, RNG and running-stat changes), halve the size."""
        self.acc.discard()
        saved.restore(self.acc.model, self._stats)
        release_memory()
        self.ooms += 1
        self._clean_windows = 0
        self._ceiling = size if self._ceiling is None else min(self._ceiling, size)
        if size == 1:
            raise NoMicroBatchFitsError(
                "out of memory at micro-batch 1: one sample does not fit beside the model, its "
                "gradients and optimizer state (see gradaccum plan); the last error was: "
                f"{self._last_oom or 'on another rank'}")
        # Halve, but not below a size that already completed a window (a failed grow goes back).
        below = [p for p in self._proven if p < size]
        self.micro_batch = max([(size + 1) // 2, *below])
        log.warning("out of memory at micro-batch %d; rerunning the global batch at %d",
                    size, self.micro_batch)

    def _snapshot(self) -> _Saved:
        return _Saved(self.acc.model, self._stats)


def _running_stats(model: torch.nn.Module | None) -> list[torch.Tensor]:
    """The buffers a forward changes: the running statistics of BatchNorm-like layers."""
    if model is None:
        return []
    return [b for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats
            for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]


class _Saved:
    """What an attempt changes besides gradients, saved at the start of a global batch."""

    def __init__(self, model: torch.nn.Module | None, stats: list[torch.Tensor]) -> None:
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if cuda_in_use() else None
        self.stats = [t.detach().clone() for t in stats]
        # DDP broadcasts buffers in a forward that follows a synchronized one; a rank whose
        # forward ran out skipped the flag's update, so every rank puts it back before a retry.
        self.ddp_flag = getattr(model, "require_forward_param_sync", None)

    def restore(self, model: torch.nn.Module | None, stats: list[torch.Tensor]) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        with torch.no_grad():
            for live, saved in zip(stats, self.stats, strict=True):
                live.copy_(saved)
        if self.ddp_flag is not None:
            model.require_forward_param_sync = self.ddp_flag  # type: ignore[union-attr]
