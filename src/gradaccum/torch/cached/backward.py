"""Representation caching (GradCache, Gao et al. 2021) as one micro-batch of the window.

A loss that couples a batch's examples (contrastive, in-batch negatives) is not a sum over
micro-batches, so accumulating micro-batch losses changes the objective. :class:`CachedBackward`
gives the exact gradient of the whole batch's loss while one chunk's graph is alive:

1. *First pass*, without grad: ``encode`` every chunk, saving the RNG state before each; the
   normalization layers' running statistics are put back afterwards (:mod:`.replay`).
2. *The loss*, once: the outputs, concatenated (under data parallel: gathered from every rank in
   rank order), become leaves that require grad; ``loss_fn`` runs on them and is backpropagated
   from the seed ``backward`` would give it (its weight in the window, scaled by a GradScaler
   once). That fills the leaves' gradient and the gradient of parameters used in ``loss_fn``
   itself (a learnable temperature), counted once.
3. *Second pass*: each chunk is encoded again under its replayed RNG state and backpropagated
   from its slice of the leaves' gradient; the graph is freed before the next chunk.

The call adds into the window's ``.grad`` in place, as ``backward`` does: it holds no second set
of gradients. It is all-or-nothing up to the second pass's first backward: an exception before it
(``encode`` in either pass, a check, ``loss_fn``, the first chunk's forward) leaves the gradients,
the running statistics, the RNG state and the window as they were (the gradient of ``loss_fn``'s
own parameters is held out of ``.grad`` until the last chunk: :mod:`.grads`). After it, the
running statistics and the RNG are put back and the gradients that did not exist before the call
are set back to None; on a window's first micro-batch that is all of them, so nothing is left.
Later in a window, the gradients held before the call have been added into: the call reports the
window as partly accumulated (:attr:`CachedBackward.partial`) and the accumulator refuses to feed,
flush or save it until ``discard()``.

**Data parallel.** Every rank computes the same global loss; rank ``r``'s encoder gradient
``J_r^T dL/dz_r`` is one term of the global gradient's sum, so its slice is multiplied by the
world size ``W`` before DDP/FSDP2 average it. A rank's count ``n_items`` is summed over the ranks
and shared equally (``N / W`` each), and a summed loss is shared as ``L / W``; then the window's
arithmetic, its item total and its loss are those of one process on the global batch. Only the
last chunk's backward of a syncing micro-batch reduces (:meth:`GradSync.pause` before the
others). A parameter DDP reduces but that only ``loss_fn`` uses is handed to that backward as an
extra root (DDP waits for its hook); parameters outside the wrapper (not DDP's, not FSDP2's
sharded ones) are averaged here, once per synced call.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from gradaccum.core.window import Window
from gradaccum.torch._grads import grads_used_anywhere
from gradaccum.torch._precision import Precision, seeded_backward
from gradaccum.torch._validate import check_total
from gradaccum.torch._weights import loss_seed, window_term
from gradaccum.torch.cached.grads import GradsBefore, LossGrads, loss_params, put_back
from gradaccum.torch.cached.loss_ranks import ranks_running_loss
from gradaccum.torch.cached.replay import NormStats, RngStates, params_read, untracked_batchnorm
from gradaccum.torch.cached.reps import Layout, check_second, expected_rows, gradient_slices, representations
from gradaccum.torch.distributed.base import GradSync, agree_on_count
from gradaccum.torch.distributed.ddp import arm_backward, needs_hook_of

__all__ = ["CachedBackward"]


@contextmanager
def _forwards(module: nn.Module | None) -> Iterator[list[bool]]:
    """``[True]`` once a forward ran through ``module`` inside the block (None: not watched)."""
    seen = [False]
    if module is None:
        yield seen
        return
    handle = module.register_forward_pre_hook(lambda *_: seen.__setitem__(0, True))
    try:
        yield seen
    finally:
        handle.remove()


def _listed(chunks: Any) -> list[Any]:
    if isinstance(chunks, (torch.Tensor, str, bytes, Mapping)) or not hasattr(chunks, "__iter__"):
        raise TypeError(f"chunks must be an iterable of micro-batches (e.g. gradaccum.chunks(batch, size)), "
                        f"got a {type(chunks).__name__}")
    return list(chunks)


def _check_result(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a scalar tensor (the batch's loss), got a "
                        f"{type(loss).__name__}: return the loss tensor, not a tuple, dict or loss.item()")
    if loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError(f"loss_fn must return a floating scalar (the batch's loss), got a {loss.dtype} "
                         f"tensor of shape {tuple(loss.shape)}: reduce it, e.g. return loss.mean()")
    if not loss.requires_grad:
        raise ValueError("loss_fn's result does not require grad: compute it from its arguments "
                         "(the representations), not from detached copies or under torch.no_grad()")
    return loss


class CachedBackward:
    """``Accumulator.backward_cached``'s two passes, for one accumulator's parts.

    Args:
        params: the optimizer's parameters.
        precision: the accumulator's mixed-precision policy (scaler, wide buffers).
        sync: its gradient sync (pause and arm per chunk; the gathers under data parallel).
        model: its ``model=``: the normalization layers to keep, the DDP/FSDP2 wrapper.

    Attributes:
        partial: after :meth:`run` raised, True when it had added into gradients the window held
            before it (the window is then partly accumulated).
    """

    def __init__(self, params: Sequence[torch.Tensor], precision: Precision, sync: GradSync,
                 model: nn.Module | None) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.params = list(params)
        self.precision = precision
        self.sync = sync
        self.model = model
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        self.checked_norms = False
        self.partial = False
        self._began = False  # the second pass's first backward has started
        self._outside: list[torch.Tensor] | None = None

    def run(self, encode: Any, loss_fn: Any, chunks: Any, window: Window, n: Any, summed: bool) -> Window:
        """Run the call against ``window``; return the window after it (the caller commits it).

        Raises:
            TypeError, ValueError, RuntimeError: bad input (see ``Accumulator.backward_cached``);
                whatever ``encode`` or ``loss_fn`` raises. Each with everything as it was, unless
                :attr:`partial` is then True.
        """
        self.partial = self._began = False  # this call's own; an earlier call's mark is gone
        for name, fn in (("encode", encode), ("loss_fn", loss_fn)):
            if not callable(fn):
                raise TypeError(f"{name} must be callable, got a {type(fn).__name__}: pass a function, "
                                "e.g. backward_cached(model, loss_fn, chunks)")
        if not torch.is_grad_enabled():
            raise RuntimeError("backward_cached needs grad mode: it was called under torch.no_grad(); "
                               "call it outside the no_grad block")
        items = _listed(chunks)
        self._agree_on_chunks(len(items))
        start, norms, before = RngStates.capture(), NormStats(self.model), GradsBefore(self.params)
        loss_grads: LossGrads | None = None
        try:
            states, results = [], []
            with torch.no_grad():
                for chunk in items:
                    states.append(RngStates.capture())
                    results.append(encode(chunk))
            norms.restore()  # the first pass's statistics updates: the second pass makes them once
            layout, leaves, own, count = representations(results, n, self.sync, rows=expected_rows(items))
            del results
            with ranks_running_loss(self.sync):  # the tiled losses share their rows out
                loss = _check_result(loss_fn(*leaves))
            share = loss / self.sync.world_size if summed and self.sync.world_size > 1 else loss
            nxt, seed = self._weigh(window, share, count, summed)
            end = RngStates.capture()
            loss_grads = LossGrads(loss_params(share, leaves))
            seeded_backward(self.precision.scale(share), seed)
            loss_grads.take()
            del loss, share
            slices = gradient_slices(layout, leaves, own, self.sync.world_size)
            del leaves
            self._second_pass(encode, items, states, layout, slices, window, norms, loss_grads)
            self.precision.collect()
        except BaseException:
            if loss_grads is not None:
                loss_grads.undo()
            self.partial = not put_back(before, self.sync, window.empty, self._began)
            norms.restore()
            start.restore()
            self.sync.prepare(window.next_is_last)
            raise
        end.restore()
        return nxt

    # ------------------------------------------------------------------ steps of run
    def _weigh(self, window: Window, loss: torch.Tensor, n: Any, summed: bool) -> tuple[Window, Any]:
        """The window after this call and the loss's backward seed, as ``backward`` weighs a loss."""
        term, scale = window_term(window, n, self.precision.overflow_prone, self.sync)
        nxt = window.advance(term, scale=scale, summed=summed,
                             losses=((loss.detach(), 1 if n is None or summed else n),))
        if not isinstance(n, torch.Tensor):
            check_total(nxt.items)
        return nxt, loss_seed(loss, n, nxt.scale, nxt.size, summed)

    def _agree_on_chunks(self, count: int) -> None:
        if self.sync.world_size == 1:
            if not count:
                raise ValueError("chunks is empty: backward_cached needs at least one chunk; pass "
                                 "gradaccum.chunks(batch, size) of a non-empty batch")
            return
        _, shortest, longest = agree_on_count(self.sync, count)
        if shortest != longest or not shortest:
            raise ValueError(f"chunks: the ranks hold from {shortest} to {longest} chunks; every rank must "
                             "give the same number (> 0) of chunks, each rank its share of the batch")

    def _second_pass(self, encode: Any, items: list[Any], states: list[RngStates], layout: Layout,
                     slices: list[list[Any]], window: Window, norms: NormStats, loss_grads: LossGrads
                     ) -> None:
        sync, ddp, last = self.sync, self.ddp, len(items) - 1
        armed = False
        unread: set[int] = set()  # parameters encode was seen not to read (params_read)
        for i, chunk in enumerate(items):
            if i == last:
                armed = sync.prepare(window.next_is_last)
            else:
                sync.pause()
            states[i].restore()
            with _forwards(ddp if armed else None) as through_wrapper:
                outs = check_second(layout, i, encode(chunk))
            floats = [t for t, floating in zip(outs, layout.floating, strict=True) if floating]
            self._check_norms(floats, norms)
            pairs = self._roots(layout, i, floats, slices[i], loss_grads.params, unread,
                                partial(params_read, partial(encode, chunk), states[i], self.model))
            self._began = True  # from here on, the call adds into the window's gradients
            if i == last:
                loss_grads.add()
                if armed and ddp is not None:
                    pairs += self._loss_roots(ddp, loss_grads.params)
                    if not through_wrapper[0]:
                        arm_backward(ddp, floats)
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            del outs, floats, pairs
        if armed and sync.world_size > 1:
            self._average_outside()

    def _roots(self, layout: Layout, chunk: int, floats: list[torch.Tensor], grads: list[Any],
               from_loss: list[torch.Tensor], unread: set[int],
               reads: Callable[[list[torch.Tensor]], list[torch.Tensor]]
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The outputs of ``chunk`` to backpropagate, each with its slice of the gradient.

        An output that does not require grad (a frozen tower) passes nothing back, as in one
        backward of the whole batch. When none the loss used does while the optimizer trains
        parameters ``loss_fn`` does not use, ``reads`` (:func:`params_read`) runs the chunk once
        more: if ``encode`` reads any of them, it detached its outputs or ran under no_grad
        (refused); else no loss reaches them, and they get no gradient, as in a full batch
        (``unread`` keeps them for the call's other chunks).

        Raises:
            ValueError: as above (raised before this chunk's backward).
        """
        outputs = [k for k, floating in enumerate(layout.floating) if floating]
        needed = [(k, t, g) for k, t, g in zip(outputs, floats, grads, strict=True) if g is not None]
        pairs = [(t, g) for _, t, g in needed if t.requires_grad]
        if needed and not pairs:
            used = {id(p) for p in from_loss}
            trainable = [p for p in self.params if p.requires_grad and id(p) not in used | unread]
            read = reads(trainable) if trainable else []
            if read:
                raise ValueError(
                    f"no output of encode that loss_fn uses requires grad in the second pass for chunk "
                    f"{chunk} (outputs {[k for k, _, _ in needed]}), yet encode reads {len(read)} "
                    "trainable parameter(s) that loss_fn does not use: encode detached its outputs or "
                    "ran under torch.no_grad() (floating outputs carry the gradient; return labels as "
                    "integer tensors). A frozen encoder (requires_grad_(False)) is accepted: its "
                    "outputs pass no gradient back, as in one backward of the whole batch")
            unread.update(id(p) for p in trainable)
        return pairs

    def _loss_roots(self, ddp: nn.Module, from_loss: list[torch.Tensor]
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The parameters DDP reduces that received a gradient from ``loss_fn``, each with its whole
        ``.grad`` as an extra root of the armed backward: DDP sees it arrive there."""
        if not needs_hook_of(ddp):  # type: ignore[arg-type]
            return []
        inside = {id(p) for p in ddp.parameters()}
        roots = []
        for p in from_loss:
            if id(p) in inside and p.grad is not None:
                grad, p.grad = p.grad, None
                roots.append((p, grad))
        return roots

    def _average_outside(self) -> None:
        """Average over the ranks the gradients of parameters the wrapper does not reduce."""
        if self._outside is None:
            from torch.distributed.tensor import DTensor

            inside = set() if self.ddp is None else {id(p) for p in self.ddp.parameters()}
            self._outside = [p for p in self.params if p.requires_grad and id(p) not in inside
                             and not isinstance(p, DTensor)]
        if not self._outside:
            return
        used = self.sync.max_over_ranks([int(p.grad is not None) for p in self._outside])
        self.sync.average_(grads_used_anywhere(self._outside, [bool(u) for u in used]))

    def _check_norms(self, floats: list[torch.Tensor], norms: NormStats) -> None:
        """Once per accumulator: warn if a BatchNorm outside ``model=`` updates its statistics in
        both passes (it is then not restored after the first)."""
        if self.checked_norms:
            return
        self.checked_norms = True
        if untracked_batchnorm(floats, norms):
            warnings.warn(
                "backward_cached: the representations came through a BatchNorm in training mode whose "
                "running statistics are not in the Accumulator's model=, so both passes update them "
                "(twice per chunk); pass the model holding it as model= (docs/CONTRASTIVE.md)",
                stacklevel=5)
