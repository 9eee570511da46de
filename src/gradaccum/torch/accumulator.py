"""The PyTorch :class:`Accumulator`: N micro-batches, one exact optimizer update (docs/GUIDE.md).

**Its shape.** The accumulator owns the state of its window: the window record
(:class:`gradaccum.core.window.Window`, immutable: each micro-batch gives a new one), the counters
and the last window's loss. It owns its parts, each made here and told only what it needs:
``Precision`` (the backward, GradScaler, wide buffers), the gradient sync (``distributed/``; a
``PipelineSync`` once ``backward_pipeline`` feeds it), ``Guard`` and ``Holders`` (the mistakes
caught), ``CachedBackward`` (``cached/``), the boundary function (``_boundary.py``, or
``pipeline/boundary.py``), the hook lists and the save watch. Every public method is defined
here, with its documentation, as a short body: it calls a function or a part's public method
with explicit arguments (the window record, the parts it needs, and where a feed runs the
accumulator's own steps, its ``_commit`` as a callback), takes back a result (the window after
the micro-batch, a checked state) and commits it. No module reads or writes the accumulator's
private attributes, and no other module defines a method of it.

One idea, one file: the window's life (open, feed, commit, close, drop, save, restore) is the
accumulator's state and nothing else's, so every method that changes it is here; the work each
step does lives in the modules named above. The per-micro-step path is ``backward`` ->
``_before_feed`` -> ``_commit`` (``_close_window`` at a boundary), with no layer between.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, NoReturn

import torch
from torch.utils.hooks import RemovableHandle

from gradaccum.core.checkpoint import COUNTERS
from gradaccum.core.schedule import Schedule, StepsSpec, as_schedule
from gradaccum.core.validate import check_nonneg_int, check_optional_positive_float, check_positive_int
from gradaccum.core.window import Window
from gradaccum.torch._boundary import Outcome, step_window
from gradaccum.torch._guards import Guard, exact_grads, refuse_entry
from gradaccum.torch._holders import Holders
from gradaccum.torch._hooks import Feed, HookList, PipelineFeed
from gradaccum.torch._micro_batch import MicroBatch, feed_block
from gradaccum.torch._param_groups import optimizer_params, param_count
from gradaccum.torch._precision import Precision
from gradaccum.torch._saves import SaveWatch
from gradaccum.torch._state import check_size, check_state, pack_state, restore_grads, restore_window
from gradaccum.torch._validate import (
    Items,
    Reduction,
    Scheduler,
    check_items,
    check_loss,
    check_parts,
    check_total,
    short_repr,
)
from gradaccum.torch._weights import loss_seed, window_term
from gradaccum.torch._window_loss import WindowLoss
from gradaccum.torch.cached.backward import CachedBackward
from gradaccum.torch.cached.grads import partial_cause, refuse_partial
from gradaccum.torch.distributed.base import GradSync, SyncMode
from gradaccum.torch.distributed.selector import PendingSync, make_sync
from gradaccum.torch.pipeline.sync import PipelineSync

__all__ = ["Accumulator", "MicroBatch"]

_FEEDS = ("backward", "backward_cached", "micro_batch", "backward_pipeline")


def _exclusive(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of an :class:`Accumulator` run while it holds the accumulator's token, taken
    without waiting (another call running is refused). ``state_dict`` may also run from the
    accumulator's own hooks (a checkpoint at a boundary), in the thread running them."""
    name = method.__name__

    @functools.wraps(method)
    def exclusive(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            self._free.pop()
        except IndexError:
            if name == "state_dict" and self._in_hooks == threading.get_ident():
                return method(self, *args, **kwargs)  # read-only, inside the call that holds it
            self._refuse(name)
        try:
            return method(self, *args, **kwargs)
        finally:
            self._free.append(True)

    return exclusive


class Accumulator:
    """Accumulate the gradients of N micro-batches and apply them as one exact update.

    Gradients add up in ``.grad``; the parameters change only at a window's boundary (unscale,
    normalize, clip, step, scheduler, zero: docs/GUIDE.md). The window's gradient is the mean of
    its micro-batch gradients, or with ``n_items`` that of ``sum(n_i * loss_i) / sum(n_i)``.

    Args:
        optimizer: the ``torch.optim.Optimizer`` to step once per window (not one whose ``step``
            needs a closure, such as LBFGS).
        steps: micro-batches per window: an int, or a schedule (a mapping ``{optimizer_step: N}``,
            a callable, or a :class:`gradaccum.Schedule`) read when each window opens.
        model: the model the forward runs through; a ``DistributedDataParallel`` or FSDP2
            (``fully_shard``) module gets one gradient sync per window (docs/DISTRIBUTED.md).
        clip_norm: clip the window gradient's global L2 norm to this value (``None``: no clip).
        scheduler: an LR scheduler whose ``step()`` takes no argument, stepped once per
            optimizer step (step ReduceLROnPlateau yourself when :meth:`backward` returns True);
            a ``scheduler.step()`` of your own beside it raises at the next window.
        scaler: a ``torch.amp.GradScaler``; pass the *unscaled* loss to :meth:`backward`.
        accum_dtype: ``torch.float32`` to sum bf16/fp16 gradients in float32 buffers (not under
            DDP/FSDP).
        skip_nonfinite: without a scaler, skip a window whose gradient norm is inf or NaN.
        sync: ``"window"`` (one gradient sync per window), ``"micro_batch"`` (every backward), or
            ``"local"``: no cross-rank work at all, for ranks that train independently on purpose
            (under a process group, any other model than DDP/FSDP2 is refused without it).

    A skipped window (non-finite gradient, or a summed window of 0 items) changes no parameter
    and counts in :attr:`skipped_windows`. If anything raises at a boundary, the next window
    starts fresh: a failed window is never applied again (docs/GUIDE.md, "Failures"). An
    accumulator is not thread-safe: feed it from one thread. Every method that reads or changes
    the window (the feeds, ``flush``, ``discard``, ``state_dict``, ``load_state_dict``,
    ``set_epoch``, ``resize_window``) raises while another one runs, from another thread or its
    own ``micro_batch()`` block (a hook may call ``state_dict``); the properties and the
    ``register_*_hook`` methods take no token. Under DDP/FSDP2, a guard that refuses on one rank
    raises on every rank at the window's boundary, which drops the window everywhere.

    Attributes:
        optimizer_steps: optimizer updates made so far (windows applied, not skipped).
        skipped_windows: windows closed without an update (non-finite gradient, 0 items).
        epoch: the epoch last given to :meth:`set_epoch` (0 before).
        grad_norm: the last window's gradient norm before clipping, a 0-dim tensor
            (with ``clip_norm`` or ``skip_nonfinite``; ``None`` when nothing computed it).
        schedule: the :class:`gradaccum.Schedule` that ``steps`` became.
        clip_norm: the clipping threshold given (``None``: no clipping).
        optimizer: the optimizer stepped once per window.
        model: the model given (``None`` when none was).
        scheduler: the LR scheduler stepped once per optimizer step (``None`` when none was).

    Raises:
        TypeError, ValueError: an argument of the wrong type or value (the message names it).

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> acc = Accumulator(opt, steps=2)
        >>> x, y = torch.randn(8, 4), torch.randn(8, 1)
        >>> [acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
        ...  for xb, yb in zip(x.split(2), y.split(2))]
        [False, True, False, True]
    """


    _window: Window
    # The thread running the user's code inside a micro_batch() block, or this accumulator's hooks
    # (set only while a call holds the accumulator): a call refused there is named as from that place.
    _in_block: int | None = None
    _in_hooks: int | None = None

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        steps: StepsSpec | Schedule,
        *positional: Any,
        model: torch.nn.Module | None = None,
        clip_norm: float | None = None,
        scheduler: Scheduler | None = None,
        scaler: torch.amp.GradScaler | None = None,
        accum_dtype: torch.dtype | None = None,
        skip_nonfinite: bool = False,
        sync: SyncMode = "window",
    ) -> None:
        if positional:  # the seed tutorial's Accumulator(optimizer, accumulate_step, clip_norm)
            raise TypeError(f"Accumulator takes optimizer and steps positionally, got {len(positional)} "
                            f"more ({short_repr(positional[0])}): clip_norm, model, scheduler, scaler and "
                            "the other options are keyword-only, e.g. Accumulator(optimizer, 4, "
                            "clip_norm=1.0)")
        self.schedule: Schedule = as_schedule(steps)
        check_parts(optimizer, model, scheduler, scaler)
        self.clip_norm = check_optional_positive_float("clip_norm", clip_norm)
        params = optimizer_params(optimizer)  # a group added later is taken in by _take_groups
        self._precision = Precision(optimizer, params, scaler=scaler, accum_dtype=accum_dtype,
                                    skip_nonfinite=skip_nonfinite, model=model)
        self._sync: GradSync = make_sync(model, sync)
        # Several data-parallel ranks: a guard's refusal is handed to the sync, which raises it on
        # every rank at the boundary (raised here alone, it would leave the others in a collective).
        self._defer: Callable[[str], None] | None = self._sync.defer if self._sync.world_size > 1 else None
        if self._precision.buffers is not None and self._sync.world_size > 1:
            if sync == "micro_batch":
                raise ValueError("accum_dtype with sync='micro_batch' would reduce every micro-batch's "
                                 "low-precision gradient: use sync='window'")
            self._sync.reduces_at_boundary = True  # type: ignore[attr-defined]
        self.optimizer = optimizer
        self.model = model
        self.scheduler = scheduler
        self._params = params
        # The accumulator's one token, taken by every public call that reads or changes the window
        # with list.pop() (atomic: of two threads, one gets it) and put back when it ends: a call
        # while another runs (another thread, or its own micro_batch() block) finds the list
        # empty and is refused. A quarter of a threading.Lock's acquire(False) and release().
        self._free: list[bool] = [True]
        self._hooks = HookList()  # after a boundary
        self._discard_hooks = HookList()
        self._feed_hooks = HookList()  # before each micro-batch's backward (gradaccum.moe)
        self._saves = SaveWatch(self, optimizer)  # an optimizer state saved mid-window without ours
        self.optimizer_steps = 0
        self.skipped_windows = 0
        self.epoch = 0
        self.grad_norm: torch.Tensor | None = None
        self._last_loss: WindowLoss | None = None
        self._partial: str | None = None  # what a backward_cached call leaving it partly accumulated raised
        self._warned_no_grad = False
        self._holders = Holders(self, params)
        self._guard = Guard(self, optimizer, params, scheduler, model, exact_grads(self._sync))
        self._cached = CachedBackward(params, self._precision, self._sync, model)
        self._boundary: Callable[..., Outcome] = step_window  # a pipeline's own once backward_pipeline feeds
        self._open_window(None)

    @property
    def micro_step(self) -> int:
        """Micro-batches fed to the current window (0 right after a boundary)."""
        return self._window.micro_step

    @property
    def steps(self) -> int:
        """Micro-batches that complete the current window (N)."""
        return self._window.size

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The ``GradScaler`` given at construction, or None."""
        return self._precision.scaler

    @property
    def grad_sync(self) -> GradSync:
        """The gradient-sync strategy picked for ``model`` (where ranks agree, e.g. AutoBatch)."""
        return self._sync

    @property
    def window_loss(self) -> torch.Tensor | None:
        """The last applied window's loss, weighted like its gradient (a 0-dim tensor; ``None``
        before the first boundary). Under DDP/FSDP2 it is the loss over every rank's items.
        Summed when read (no cost for a loop that never logs it, no GPU sync)."""
        return None if self._last_loss is None else self._last_loss.value()

    @property
    def windows(self) -> int:
        """Windows applied so far: optimizer steps plus skipped windows."""
        return self.optimizer_steps + self.skipped_windows

    @property
    def world_size(self) -> int:
        """Data-parallel ranks the window's gradients are averaged over (1 without DDP/FSDP2)."""
        return self._sync.world_size

    def backward(self, loss: torch.Tensor, n_items: Items = None, *, reduction: Reduction = "mean") -> bool:
        """Feed one micro-batch: backward its loss into the window's gradient.

        Args:
            loss: the micro-batch's loss, a scalar that requires grad: its mean over the items
                (``reduction="mean"``, a criterion's default) or its sum (``"sum"``).
            n_items: the micro-batch's number of items (non-padding tokens) or total weight: an
                int, a float or a 0-dim tensor, >= 0 (> 0 with ``"mean"``). Give it on every
                micro-batch of a window or on none; ``"sum"`` requires it.
            reduction: ``"mean"`` or ``"sum"``. A summed micro-batch of 0 items adds nothing;
                a window whose total is 0 takes no step.

        Returns:
            True when this call completed the window and the optimizer stepped.

        Raises:
            TypeError, ValueError: a bad ``loss``, ``n_items`` or ``reduction``, or a window that
                would mix weightings; raised before anything changes.
            RuntimeError: a stale or edited gradient, your own ``scheduler.step()``, another
                accumulator's window, a concurrent call (docs/GUIDE.md, "Errors"). Under several
                DDP/FSDP2 ranks a guard's refusal is raised on every rank at the boundary, and
                the window is dropped.
        """
        n = check_items(n_items, reduction)
        check_loss(loss)
        try:  # inline: no call more on the per-micro-step path
            self._free.pop()
        except IndexError:
            self._refuse("backward")
        try:
            summed = reduction == "sum"
            window = self._window
            self._before_feed(window)
            term, scale = window_term(window, n, self._precision.overflow_prone, self._sync)
            nxt = window.advance(term, scale=scale, summed=summed,
                                 losses=((loss.detach(), 1 if n is None or summed else n),))
            if not isinstance(n, torch.Tensor):
                check_total(nxt.items)
            seed = loss_seed(loss, n, nxt.scale, nxt.size, summed)
            if self._feed_hooks.registered:  # a dict's truth, no call on the hot path
                self._feed_hooks(Feed(window.micro_step, n, reduction, seed))
            self._precision.backward(loss, seed)
            return self._commit(nxt)
        finally:
            self._free.append(True)

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
        self._enter("backward_cached")
        try:
            self._before_feed(self._window)
            try:
                window = self._cached.run(encode, loss_fn, chunks, self._window, n, reduction == "sum")
            except BaseException as e:
                if self._cached.partial:
                    self._partial = partial_cause(e)
                raise
            return self._commit(window)
        finally:
            self._free.append(True)

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
        self._enter("micro_batch")
        try:
            window = self._window
            self._before_feed(window)
            with feed_block(window, n, reduction == "sum", self._precision, self._sync, self._guard,
                            self._commit, self._feed_hooks) as mb:
                self._in_block = threading.get_ident()
                try:
                    yield mb
                finally:
                    self._in_block = None
        finally:
            self._free.append(True)

    def backward_pipeline(self, schedule: Any, *args: Any, target: Any = None, n_items: Any = None,
                          reduction: Reduction = "mean", **kwargs: Any) -> bool:
        """Feed one ``schedule.step(*args, target=target, **kwargs)`` of a ``torch.distributed.
        pipelining`` schedule as one micro-batch of the window, on every stage and replica alike
        (docs/PIPELINE.md).

        Args:
            schedule: built on this rank's stage(s), with a ``loss_fn`` and ``scale_grads=False``.
            *args: the model's inputs (on the first stage).
            target: the batch's labels, on the last stage.
            n_items: on the last stage only: a function of a pipeline micro-batch's target giving its
                count (``gradaccum.count_tokens``), or with ``"sum"`` the batch's count; ``None``:
                every pipeline micro-batch weighs alike.
            reduction: how ``loss_fn`` reduces a micro-batch's items, ``"mean"`` or ``"sum"``.
            **kwargs: for ``schedule.step`` (``losses=[]`` gets each unweighted loss).

        Returns:
            True on every stage when this call completed the window and the optimizer stepped.

        Raises:
            ValueError: a bad input on any rank, raised on every rank together: before any
                ``step()`` at the run's first call, else at the window's boundary (no rank steps).
            TypeError, ValueError, RuntimeError, NotImplementedError: a feed hook
                (``gradaccum.moe.LoadBalance``) refused the call, before anything changes.
        """
        from gradaccum.torch.pipeline.boundary import step_pipeline_window
        from gradaccum.torch.pipeline.feed import attach, feed

        self._enter("backward_pipeline")
        try:  # the feed hooks (gradaccum.moe) are told first: a refusal changes nothing
            before_step = self._pipeline_feed(schedule, reduction) if self._feed_hooks else None
            sync = self._sync
            if not isinstance(sync, PipelineSync):  # the first call: the window spans the stages
                sync = attach(schedule, sync, self._params, self._precision, self._window, self)
                self._sync, self._boundary, self._defer = sync, step_pipeline_window, sync.defer
                self._guard.set_exact(exact_grads(sync))  # reduced at the boundary only (or each call)
            nxt = feed(sync, schedule, args, target, n_items, reduction, kwargs, self._window,
                       self._precision, self.clip_norm, self._check_grads, before_step)
            stepped = self._commit(nxt)
            sync.agreed = (schedule, self._window)  # the next call agrees again only if either changes
            return stepped
        finally:
            self._free.append(True)

    def _pipeline_feed(self, schedule: Any, reduction: Reduction) -> Callable[[bool, Any], None]:
        """Tell the feed hooks of a ``backward_pipeline`` call before anything changes (they may
        refuse it, on every rank alike), and return what tells them its weights before ``step()``."""
        from gradaccum.torch.pipeline.sync import schedule_stages

        stages = schedule_stages(schedule)
        n_mb = int(getattr(schedule, "_n_microbatches", 1))
        micro_step, steps = self._window.micro_step, self._window.size
        self._feed_hooks(Feed(micro_step, None, reduction, None, PipelineFeed(stages, n_mb, steps)))

        def before_step(items: bool, scale: Any) -> None:
            info = PipelineFeed(stages, n_mb, steps, items, scale, self._sync.world_size)
            self._feed_hooks(Feed(micro_step, None, reduction, None, info))
        return before_step

    def flush(self) -> bool:
        """Apply a partial window now (end of data), as the mean over what it holds; under
        DDP/FSDP2 every rank must call it. Returns True when the optimizer stepped.

        Raises:
            ValueError: under DDP/FSDP2, the ranks hold windows of different lengths (raised on
                every rank, before anything changes).
            RuntimeError: a gradient edited during the window, a concurrent call, or a
                ``backward_cached`` call that left the window partly accumulated (:meth:`discard`
                it); nothing changes. Under several DDP/FSDP2 ranks the edited gradient is raised
                on every rank at the boundary instead, and the window is dropped.
        """
        self._enter("flush")
        try:
            refuse_partial(self._partial, self.micro_step)
            try:
                self._guard.grads.check(self._window.micro_step, self._window.size, True)
            except RuntimeError as e:
                if self._defer is None:
                    raise
                self._defer(str(e))  # every rank raises at the boundary: none waits in a collective
            if self._window.terms and not self._window.complete:
                raise ValueError(
                    f"flush() of a window holding {self.micro_step} of {self.steps} micro-batches and a "
                    "term with its own total (mb.term(..., total=)): that total was the full "
                    "window's; discard() it, or give the short window its own totals and steps")
            self._sync.sync_partial(self._params, self._window.micro_step)
            return not self._window.empty and self._close_window()
        finally:
            self._free.append(True)

    @_exclusive
    def discard(self) -> None:
        """Drop the partial window (gradients to None, counters to the window's start), then call
        the hooks of :meth:`register_discard_hook`."""
        basis = self._window.basis
        self._holders.discard_others()
        self._sync.discard()
        self._clear(basis)
        self._guard.scheduled()  # a scheduler step of yours was refused or dropped with the window
        self._open_window(basis)
        self._run_hooks(self._discard_hooks)

    @_exclusive
    def set_epoch(self, epoch: int) -> None:
        """Tell an epoch schedule (``Schedule(..., by="epoch")``) that epoch ``epoch`` begins; an
        empty window takes its N at once. Raises TypeError/ValueError unless ``epoch >= 0``."""
        epoch = check_nonneg_int("epoch", epoch)
        self.epoch = epoch
        if self._window.empty:
            self._open_window(self._window.basis)

    @_exclusive
    def resize_window(self, steps: int) -> None:
        """Give the current, empty window another size (for :class:`gradaccum.AutoBatch`, which
        learns a window's size from its data); the schedule is read again at the next window.
        Raises TypeError/ValueError for ``steps < 1`` or a started window (nothing changes)."""
        n = check_positive_int("steps", steps)
        if not self._window.empty:
            raise ValueError(f"resize_window(steps={n}) needs an empty window; it holds "
                             f"{self.micro_step} of {self.steps} micro-batches")
        self._window = self._window.resized(n)
        self._sync.prepare(self._window.next_is_last)

    @_exclusive
    def state_dict(self) -> dict[str, Any]:
        """All a bit-exact resume in the middle of a window needs (counters, window, partial
        gradients and losses, the last window's loss); save it beside the model's and optimizer's.

        Raises:
            RuntimeError: mid-window under FSDP2 with ``sync="window"``, whose partial gradients
                live inside FSDP2 (save at ``micro_step == 0``); a window a ``backward_cached``
                call left partly accumulated (``discard()`` it).
        """
        refuse_partial(self._partial, self._window.micro_step)
        if not self._window.empty:
            self._sync.check_saveable()
        state = pack_state(self._window, self.schedule.describe(), {k: getattr(self, k) for k in COUNTERS},
                           self.window_loss, self._params, self._precision.state_dict())
        self._saves.own_saved(self.windows, self.micro_step)
        return state

    @_exclusive
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`, partial gradients included.

        The window resumes at the size it was saved with (the one it opened with: a window
        carried into a new epoch by :meth:`set_epoch`, or sized by :meth:`resize_window`, keeps
        it); the next window reads the schedule. Every state :meth:`state_dict` writes loads
        into an accumulator built the same way. Parameter groups the optimizer gained since the
        accumulator was built (progressive unfreezing, added again on resume) are taken in first.

        Raises:
            TypeError, ValueError: a field is missing, of the wrong type or out of range (the
                message names the key), or the state comes from an accumulator with another
                ``steps`` or other parameters; nothing is changed then.
            RuntimeError: another live accumulator holds a partial window over these parameters
                (loading would overwrite its gradients); nothing is changed.
        """
        params = optimizer_params(self.optimizer)  # a group added since is taken in with the state
        window = check_state(state, self.schedule.describe(), params)
        check_size(window, self.schedule, state)
        if len(params) != len(self._params):
            self._take_groups()  # the state's window replaces this one, gradients and all
        self._precision.check_state(state.get("accum"))
        # Loading sets the shared .grad (to None for an empty window): never under another's window.
        self._holders.refuse_overlap("load a partial window" if not window.empty else
                                     "load a state with an empty window", "overwrite")
        restore_grads(self._params, state["grads"])
        self._partial = None  # every gradient and the window are the state's
        self._precision.load_state_dict(state.get("accum"))
        for key in COUNTERS:
            setattr(self, key, state[key])
        last = state.get("window_loss")
        self._last_loss = None if last is None else WindowLoss(((last, 1),), 1)
        self._window = restore_window(state, window)
        self._sync.prepare(self._window.next_is_last)
        self._holders.adopt()
        self._guard.scheduled()  # the learning rates (a scheduler's state loaded beside) are read anew
        self._guard.resume(self._window.micro_step)

    def register_boundary_hook(self, hook: Callable[[Any], None]) -> RemovableHandle:
        """Call ``hook(accumulator)`` after every window is applied (stepped or skipped).

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        return self._hooks.register(hook)

    def register_discard_hook(self, hook: Callable[[Any], None]) -> RemovableHandle:
        """Call ``hook(accumulator)`` after ``discard()`` drops a partial window.

        For state pooled over a window outside the accumulator (a window BatchNorm's statistics),
        which a discarded window must not leave behind.

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        return self._discard_hooks.register(hook)

    def register_feed_hook(self, hook: Callable[[Feed], None]) -> RemovableHandle:
        """Call ``hook(feed)`` right before each backward of :meth:`backward` and of
        :meth:`micro_batch`'s ``mb.backward``, with a named tuple ``feed``: the window's
        ``micro_step``, the ``n_items`` and ``reduction`` given, and the ``seed`` the backward
        starts from (None: 1; an active GradScaler's scale multiplies it). For a loss term
        entered inside the user's backward at a weight of its own (``gradaccum.moe``); what the
        hook raises propagates before the backward runs, with nothing changed. A
        :meth:`backward_pipeline` call tells it twice, ``feed.pipeline`` a ``PipelineFeed``
        (torch/_hooks.py): before anything changes (to refuse), and before ``step()`` with the
        window's weighting (``n_items`` and ``seed`` None).

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        return self._feed_hooks.register(hook)

    # ------------------------------------------------------------------ one call at a time
    def _enter(self, method: str) -> None:
        """Take the accumulator's token for ``method`` (the caller puts it back in ``_free`` when
        it ends), or refuse it while another call holds it. ``backward`` does the same inline."""
        try:
            self._free.pop()
        except IndexError:
            self._refuse(method)

    def _refuse(self, method: str) -> NoReturn:
        """Refuse ``method``: another call of this accumulator holds it. From the code inside a
        ``micro_batch()`` block (whose micro-batch is still being fed: its gradients partly added,
        its window not yet advanced), a call that is not a feed is named as such.

        Raises:
            RuntimeError: naming the fix; nothing has changed.
        """
        here = threading.get_ident()
        if self._in_block == here and method not in _FEEDS:
            raise RuntimeError(
                f"acc.{method}() was called inside an acc.micro_batch() block, whose micro-batch is "
                "still being fed: leave the block first (to drop the micro-batch, raise out of the "
                "block, then call acc.discard()); nothing has changed") from None
        if self._in_hooks == here:
            raise RuntimeError(
                f"acc.{method}() was called from a boundary or discard hook of this accumulator, "
                "while the call that runs the hook still holds it (only acc.state_dict() may be "
                "called there): make that call after acc.backward() (or flush(), discard()) "
                "returns; nothing has changed") from None
        refuse_entry(method)

    def _run_hooks(self, hooks: HookList) -> None:
        """Run ``hooks`` (the call running them holds the accumulator: they may read
        :meth:`state_dict`, and any other call of theirs is refused)."""
        self._in_hooks = threading.get_ident()
        try:
            hooks(self)
        finally:
            self._in_hooks = None

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``) gets its own token, free, and no call running."""
        state = self.__dict__.copy()
        for key in ("_in_block", "_in_hooks"):
            state.pop(key, None)
        state["_free"] = [True]
        return state

    # ------------------------------------------------------------------ the window's steps

    def _open_window(self, basis: Any) -> None:
        self._partial = None
        count = self.epoch if self.schedule.by == "epoch" else self.optimizer_steps
        self._window = Window.open(self.schedule(count), basis, count)
        self._sync.prepare(self._window.next_is_last)

    def _before_feed(self, window: Window) -> None:
        """Before a micro-batch's backward: its window's first is checked against the other
        accumulators (torch/_holders.py), stale gradients and the scheduler, a later one against
        gradients changed outside (torch/_guards.py). A window a ``backward_cached`` call left
        partly accumulated is refused."""
        if self._partial is not None:
            refuse_partial(self._partial, window.micro_step)
        if isinstance(self._sync, (PendingSync, PipelineSync)):
            self._sync.refuse_feed()  # a pipeline stage's window: backward_pipeline only
        try:
            self._check_grads(window)
        except RuntimeError as e:
            if self._defer is None:
                raise
            self._defer(str(e))  # the micro-batch runs (its collectives too); the boundary raises

    def _check_grads(self, window: Window) -> None:
        """The guards of :meth:`_before_feed`; alone for a ``backward_pipeline`` call (which records
        what they raise as a problem of the call, and raises it on every rank together)."""
        if window.micro_step:
            self._guard.check(window.micro_step, window.size)
        else:
            if param_count(self.optimizer) != len(self._params):
                self._take_groups()
            self._holders.check_first()
            self._guard.check_first()  # stale gradients, a scheduler stepped outside

    def _take_groups(self) -> None:
        """The optimizer gained (or lost) parameter groups since its parameters were taken
        (``add_param_group``: progressive unfreezing): before the window's first micro-batch,
        every part that holds the parameters takes the new list, as a new accumulator would
        (torch/_param_groups.py).

        Raises:
            RuntimeError: under ``backward_pipeline`` (its stages were checked against the
                parameters at its first call); nothing has changed.
            ValueError: as the constructor, for the new parameters; nothing has changed.
        """
        if isinstance(self._sync, PipelineSync):
            raise RuntimeError("optimizer.add_param_group() after backward_pipeline's first call: the "
                               "pipeline's stages were matched to the optimizer's parameters then; "
                               "build a new Accumulator over the optimizer after adding the group (at "
                               "a boundary). Nothing has changed")
        params = optimizer_params(self.optimizer)
        self._precision.adopt(params, self.model)  # raises first, if the new parameters cannot be taken
        self._params = params
        self._holders = Holders(self, params)
        self._guard.adopt(params)
        self._cached = CachedBackward(params, self._precision, self._sync, self.model)

    def _commit(self, window: Window) -> bool:
        self._window = window
        if window.micro_step >= window.size:
            return self._close_window()
        self._guard.note()  # the gradients as this micro-batch left them, checked before the next
        if window.micro_step + 1 == window.size:
            # DDP reads the flag in its forward, so it is set before the next micro-batch runs.
            self._sync.prepare(True)
        return False

    def _close_window(self) -> bool:
        """The boundary, as a transaction: the window is stepped, counted and cleared, and the
        next one opens, whatever raises (a failed window is never applied again)."""
        window = self._window
        try:
            with self._guard.own_step(self._defer):
                out = self._boundary(window, self._sync, self._precision, self.clip_norm)
        except BaseException:
            stepped = self._precision.stepped_before_error
            self._precision.abort()
            self._clear(window.basis)
            with suppress(Exception):
                if stepped:  # the optimizer stepped, then a hook or the scaler raised
                    self._count(Outcome(True, window.basis))
                self._open_window(window.basis)
            raise
        self._clear(out.basis)
        try:
            self._count(out)
            self._run_hooks(self._hooks)
        finally:
            self._open_window(out.basis)
        return out.stepped

    def _count(self, out: Outcome) -> None:
        """The bookkeeping of a closed window: loss, norm, counters, scheduler."""
        if out.loss is not None:
            self._last_loss = out.loss
            self.grad_norm = out.grad_norm
        if out.no_grads and not self._warned_no_grad:
            self._warned_no_grad = True
            warnings.warn("no parameter of the optimizer received a gradient in this window (a loss from "
                          "another model, or a detached graph?): build the optimizer over the parameters "
                          "the loss is computed from, SGD(model.parameters()), and do not detach the "
                          "model's output", stacklevel=5)
        if not out.stepped:
            self.skipped_windows += 1
            return
        self.optimizer_steps += 1
        if self.scheduler is not None:
            self._guard.step_scheduler(self.scheduler)

    def _clear(self, basis: Any = None) -> None:
        """Gradients to None and an empty window of the same size (should opening the next
        window raise, e.g. on a bad schedule value, no micro-batch is applied twice)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._precision.clear()
        self._guard.forget()
        self._window = Window(self._window.size, basis=basis, opened_at=self._window.opened_at)

    def __del__(self) -> None:
        # Dropped with a partial window: its gradients stay in .grad; the next accumulator over
        # these parameters discards them with a warning (torch/_holders.py).
        with suppress(Exception):
            self._guard.remove()
            if self._window.micro_step:
                self._holders.orphan(self._window.micro_step, self._window.size)

    def __repr__(self) -> str:
        steps, micro, done = self.schedule.describe(), self.micro_step, self.optimizer_steps
        return f"Accumulator(steps={steps!r}, micro_step={micro}, optimizer_steps={done})"
