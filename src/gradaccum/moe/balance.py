""":class:`LoadBalance`: a mixture of experts' load-balancing loss of the whole window, its gradient
entered inside the user's own ``acc.backward`` (docs/MOE.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradaccum.core.balance import check_mode
from gradaccum.moe._inject import Site, inject
from gradaccum.moe._pipeline import PipeTracker, check_pipeline
from gradaccum.moe._routers import check_aux_off, find_routers, logits_of, switch_aux_off
from gradaccum.moe._window import Batches, PreparedWindow, mask_rows
from gradaccum.torch import Accumulator
from gradaccum.torch._hooks import Feed, HookList
from gradaccum.torch.cached.replay import NormStats, RngStates

__all__ = ["LoadBalance"]


class _StopPrePass(Exception):
    """Raised by the last router of a pre-pass forward: the rest of the model is not needed."""


def _in_backward() -> bool:
    """True inside a backward pass (a checkpoint's recomputation): its routes were counted."""
    return bool(torch._C._current_graph_task_id() != -1)


def _default_forward(model: nn.Module) -> Callable[[Any], Any]:
    def forward(batch: Any) -> Any:
        return model(**batch) if isinstance(batch, dict) else model(batch)
    return forward


def _default_mask(batch: Any) -> Any:
    return batch.get("attention_mask") if isinstance(batch, dict) else None


class LoadBalance:
    """The load-balancing loss of a mixture of experts over the whole window, exact across
    micro-batches and ranks.

    The loss of a batch, ``coef * E * sum_i f_i P_i`` (``f_i``: the fraction of routes to expert
    ``i``; ``P_i``: its mean router probability), is a statistic of the batch: computed per
    micro-batch it trains another objective. ``LoadBalance`` switches the model's own auxiliary
    loss off and adds the gradient of the window's loss inside each micro-batch's own backward
    (``acc.backward``, ``acc.micro_batch``), with the weight that makes the window's update the
    large batch's, whatever ``n_items`` the language-model loss uses. Under
    ``acc.backward_pipeline``, ``"rolling"`` and ``"micro_batch"`` with ``per_layer=True`` run per
    pipeline micro-batch, each stage's gradient in its own backward (docs/MOE.md, "Pipeline").

    Args:
        model: the model (a Hugging Face MoE model: Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE; or any
            module, with ``routers=``), plain or wrapped in DDP / FSDP2.
        coef: the loss's coefficient, >= 0 (default: the config's ``router_aux_loss_coef``).
        mode: ``"global"``: the window's own counts, from a no-grad pre-pass of its micro-batches
            (exact); ``"rolling"``: the counts so far in the window (this micro-batch's included,
            every rank); ``"micro_batch"``: each micro-batch's own loss (Hugging Face's), weighted
            by its share of the window's tokens over every rank.
        routers: the router modules, if not a Hugging Face model: each returns its logits
            ``(tokens, experts)``, or a tuple holding them first.
        num_experts: experts per layer (default: the config's, else the logits' last dimension).
        top_k: routes per token (default: the config's ``num_experts_per_tok``).
        per_layer: sum each layer's loss (Switch, Megatron, torchtitan: ``f`` the fraction of the
            layer's routes) instead of pooling the layers as ``load_balancing_loss_func`` does.

    Attributes:
        load: the last window's routes per layer and expert, summed over the ranks (float64
            ``(layers, experts)``; None before the first window).
        mode: the mode given.
        model: the model given.
        coef: the loss's coefficient (given, or the config's).
        top_k: routes per token (given, or the config's).
        per_layer: the layers' losses summed (True) or pooled (False).

    Raises:
        TypeError, ValueError: no router found and none given, a misspelled mode, ``coef`` < 0
            or not finite, a bad number; nothing is changed (the model's aux loss stays as it was).

    Example:
        >>> import torch, gradaccum
        >>> from gradaccum.moe import LoadBalance
        >>> router = torch.nn.Linear(4, 3)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), router)
        >>> acc = gradaccum.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
        >>> balance = LoadBalance(model, routers=[router], top_k=1, coef=0.01)
        >>> loader = [torch.randn(5, 4) for _ in range(4)]
        >>> for window in balance.windows(loader, acc, mask=lambda x: torch.ones(len(x))):
        ...     for x in window:
        ...         stepped = acc.backward(model(x).pow(2).mean())
        >>> acc.optimizer_steps, tuple(balance.load.shape)
        (2, (1, 3))
    """

    def __init__(self, model: nn.Module, *, coef: float | None = None, mode: str = "global",
                 routers: Iterable[nn.Module] | None = None, num_experts: int | None = None,
                 top_k: int | None = None, per_layer: bool = False) -> None:
        self.mode = check_mode(mode)
        if not isinstance(per_layer, bool):
            raise TypeError(f"per_layer must be True or False, got {per_layer!r}")
        found = find_routers(model, None if routers is None else list(routers), num_experts, top_k, coef)
        self.model = model
        self.coef = found.coef
        self.top_k = found.top_k
        self.per_layer = per_layer
        self._found = found
        self._experts = found.experts
        self._layer = {id(m): i for i, m in enumerate(found.modules)}
        self._on_window = HookList()
        self.load: torch.Tensor | None = None
        self._window: PreparedWindow | None = None
        self._pre: tuple[int, PreparedWindow, set[int]] | None = None  # in a pre-pass forward
        self._acc: Accumulator | None = None
        self._feed_handle: RemovableHandle | None = None
        self._boundary_handle: Any = None
        self._early_stop = not _distributed(model)
        self._pipe: PipeTracker | None = None  # under backward_pipeline (moe/_pipeline.py)
        self._fast = False  # the pre-pass under inference_mode (from the second window on)
        switch_aux_off(found.config)
        self._handles = [m.register_forward_hook(self._router_hook) for m in found.modules]

    @property
    def routers(self) -> tuple[nn.Module, ...]:
        """The router modules, in model order."""
        return self._found.modules

    def on_window(self, fn: Callable[[torch.Tensor], None]) -> RemovableHandle:
        """Call ``fn(load)`` once per window, at its boundary, with the window's load
        (:attr:`load`): for DeepSeek-V3's auxiliary-loss-free bias, one update per optimizer step
        from the whole window's load.

        Returns:
            A handle whose ``remove()`` unregisters ``fn``.
        """
        if not callable(fn):
            raise TypeError(f"on_window takes a function of the load, got {type(fn).__name__}")
        return self._on_window.register(fn)

    def remove(self) -> None:
        """Take every hook off the routers and the accumulator (the model's aux loss stays off)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._feed_handle is not None:
            self._feed_handle.remove()
            self._boundary_handle.remove()
            self._feed_handle = None

    def windows(self, loader: Iterable[Any], acc: Accumulator, *, forward: Callable[[Any], Any] | None = None,
                mask: Callable[[Any], Any] | None = None, n_items: Callable[[Any], Any] | None = None
                ) -> Iterator[list[Any]]:
        """The windows of ``loader``, each a list of ``acc.steps`` micro-batches, read before they
        train: feed each micro-batch through ``acc.backward`` (or ``acc.micro_batch``).

        Args:
            loader: the micro-batches (a short last window is applied by ``acc.flush()``).
            acc: the accumulator the micro-batches are fed to.
            forward: runs one micro-batch's forward for the pre-pass (default ``model(**batch)``,
                ``model(batch)`` for a batch that is not a dict).
            mask: a batch's token mask, the rows the routes are counted over (default
                ``batch["attention_mask"]``; None: every row counts, ``"global"`` only).
            n_items: the count function of the ``n_items`` given to ``acc.backward`` (e.g.
                ``lambda b: gradaccum.count_tokens(b["labels"], shift=True)``); needed when the
                backward is item-weighted.

        Yields:
            The window's micro-batches, a list.

        Raises:
            TypeError, ValueError: a bad argument, a window that differs from the one prepared, a
                backward item-weighted without ``n_items=``, the model's aux loss turned back on;
                before the micro-batch's backward.
            RuntimeError: ``acc.backward`` of a balanced model outside ``windows()``.
            ValueError: ``mode="global"`` with an accumulator of a pipeline stage (its pre-pass
                would be a run of the schedule): the message names ``"rolling"``.
        """
        if not isinstance(acc, Accumulator):
            raise TypeError(f"acc must be a gradaccum.Accumulator, got {type(acc).__name__}")
        for name, fn in (("forward", forward), ("mask", mask), ("n_items", n_items)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function of a batch, got {type(fn).__name__}")
        if self.mode == "global" and _pipelined(acc):
            check_pipeline(self.mode, self.per_layer, None)  # raises, naming "rolling"
        self._attach(acc)
        run = forward or _default_forward(self.model)
        mask_of = mask or _default_mask
        batches_of = iter(loader)
        while True:
            if acc.micro_step:
                raise RuntimeError(f"balance.windows() opens a window on an empty accumulator; it holds "
                                   f"{acc.micro_step} micro-batches (flush() or discard() them first)")
            batches = list(islice(batches_of, acc.steps))
            if not batches:
                return
            for batch in batches:
                check_aux_off(self._found.config, batch)
            window, states = self._prepare(batches, acc, run, mask_of, n_items)
            self._window = window
            try:
                yield Batches(batches, states)
                if acc.micro_step == len(batches) and len(batches) < acc.steps:
                    acc.flush()  # the short last window, as its own mean
                elif acc.micro_step:
                    raise RuntimeError(f"the window's {len(batches)} micro-batches were not all fed "
                                       f"({acc.micro_step} were): feed each through acc.backward")
                window.check_items()
                self.load = window.close()
            finally:
                self._window = None
            self._on_window(self.load)

    # ------------------------------------------------------------------ preparing a window
    def _attach(self, acc: Accumulator) -> None:
        if self._acc is acc and self._feed_handle is not None:
            return
        if self._feed_handle is not None:
            self._feed_handle.remove()
            self._boundary_handle.remove()
        self._acc = acc
        self._feed_handle = acc.register_feed_hook(self._before_backward)
        self._boundary_handle = acc.register_boundary_hook(self._at_boundary)

    def _at_boundary(self, acc: Any) -> None:
        if self._window is not None:
            self._window.done = True  # applied: a later micro-batch is not this window's

    def _prepare(self, batches: list[Any], acc: Accumulator, run: Callable[[Any], Any],
                 mask_of: Callable[[Any], Any], n_items: Callable[[Any], Any] | None
                 ) -> tuple[PreparedWindow, list[RngStates] | None]:
        raw = [mask_of(b) for b in batches]
        masks = [mask_rows(m) for m in raw]
        if self.mode != "global" and any(m is None for m in masks):
            raise ValueError(f"mode={self.mode!r} needs each batch's token mask to know the window's "
                             "tokens before it trains: give mask=lambda batch: ... (or batches with "
                             "'attention_mask'), or use mode='global'")
        shape = (len(self.routers), self._experts, self.top_k, self.per_layer, self.coef, self.mode)
        window = PreparedWindow(len(batches), masks, shape, acc.world_size)
        known = [m.sum() for m in masks if m is not None]
        sums = iter(torch.stack(known).tolist() if known else [])  # one host read per window
        window.rows = [None if m is None else next(sums) for m in masks]
        window.leads = [m.shape[0] if isinstance(m, torch.Tensor) and m.dim() else 1 for m in raw]
        items = None if n_items is None else [n_items(b) for b in batches]
        states = self._pre_pass(window, batches, run) if self.mode == "global" else None
        window.finish_prepare(items)
        return window, states

    def _pre_pass(self, window: PreparedWindow, batches: list[Any], run: Callable[[Any], Any]
                  ) -> list[RngStates]:
        """Every micro-batch's forward without grad, counting the routes; the random state each
        started from is kept (the training forward replays it) and the first one put back.

        On one process, from the second window on, the forwards run under ``torch.inference_mode``
        (about a quarter cheaper than ``no_grad`` on a small model: no autograd dispatch); the
        first runs under ``no_grad``, so that what a model makes lazily in its first forward is
        an ordinary tensor, and a buffer made in an inference pre-pass is copied out of it."""
        states = []
        norms = NormStats(self.model)
        fast = self._fast
        try:
            for j, batch in enumerate(batches):
                states.append(RngStates.capture())
                self._pre = (j, window, set())
                try:
                    with torch.inference_mode() if fast else torch.no_grad():
                        run(batch)
                except _StopPrePass:
                    pass
                if window.counts[j] is None:
                    raise ValueError("no router ran in the pre-pass forward of micro-batch "
                                     f"{j}: forward= must run the model the routers are in")
        finally:
            self._pre = None
            norms.restore()
            if fast:
                _ordinary_buffers(self.model)
            if states:
                states[0].restore()
        self._fast = self._early_stop
        return states

    # ------------------------------------------------------------------ the hooks
    def _router_hook(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        layer = self._layer[id(module)]
        pre, window, pipe = self._pre, self._window, self._pipe
        if pipe is not None and pipe.inferring:
            return None  # a pipeline schedule's metadata inference: a forward no call trains on
        if pre is None and window is None:
            if torch.is_grad_enabled() and module.training:
                raise RuntimeError(
                    "a training forward of a model balanced by LoadBalance outside balance.windows(): "
                    "its balancing gradient would be missing; train inside `for window in "
                    "balance.windows(loader, acc): for batch in window: acc.backward(...)` (evaluate "
                    "under torch.no_grad() or model.eval(); balance.remove() takes the hooks off)")
            return None  # an evaluation forward: nothing to count or add
        logits = logits_of(output, self._found.index, module)
        rows = logits.reshape(-1, logits.shape[-1])
        if self._experts is None:
            self._experts = rows.shape[-1]  # from the first logits seen
        experts = self._experts
        if rows.shape[-1] != experts:
            raise ValueError(f"router {type(module).__name__} gave logits of {rows.shape[-1]} experts, "
                             f"expected num_experts={experts}")
        if pipe is not None and pipe.chunk is not None and pre is None:
            window, j = self._forward_index(window, "")
            return pipe.router(window, j, layer, rows, self.top_k, not _in_backward(), output, logits)
        if pre is not None:
            j, prepared, fired = pre
            if prepared.masks[j] is None and not fired:
                prepared.rows[j] = rows.shape[0]
            self._count(prepared, prepared.counts, j, layer, rows)
            fired.add(layer)
            if self._early_stop and len(fired) == len(self._layer):
                raise _StopPrePass
            return None
        window, j = self._forward_index(window, " (feed the window's micro-batches as windows() gives them)")
        rows = rows.detach()
        if not _in_backward():  # a checkpoint's recomputation was counted in the forward
            self._count(window, window.seen_routes, j, layer, rows)
        if not torch.is_grad_enabled():
            return None
        return inject(output, logits, Site(rows, window.mask_cols[j], layer, window.slots[j], logits.shape))

    def _count(self, window: PreparedWindow, store: list[torch.Tensor | None], j: int, layer: int,
               rows: torch.Tensor) -> None:
        mask = window.masks[j]
        if mask is not None and mask.numel() != rows.shape[0]:
            raise ValueError(f"the mask of micro-batch {j} has {mask.numel()} tokens but router "
                             f"{layer} routed {rows.shape[0]} rows: mask= must give one value per "
                             "routed token, in the router's order")
        window.count(store, j, layer, rows)

    def _before_backward(self, feed: Feed) -> None:
        window = self._window
        if window is None:
            raise RuntimeError(
                "acc.backward of a model balanced by LoadBalance outside balance.windows(): feed its "
                "micro-batches inside `for window in balance.windows(loader, acc): for batch in "
                "window: acc.backward(...)`; nothing has changed")
        j = feed.micro_step
        if j >= window.size or window.done:
            raise ValueError(f"a backward of one more micro-batch than the {window.size} of the window "
                             "LoadBalance prepared: a window that differs from the one prepared; nothing "
                             "has changed")
        if feed.pipeline is not None:  # a backward_pipeline call (moe/_pipeline.py)
            self._before_step(window, j, feed.pipeline)
            return
        if window.masks[j] is None and window.rows[j] is None:
            raise ValueError("no router ran in this micro-batch's forward")
        slot = window.fill(j)
        slot.weight = window.weight(feed, None if self._acc is None else self._acc.scaler)

    def _forward_index(self, window: PreparedWindow | None, hint: str) -> tuple[PreparedWindow, int]:
        """The window and the prepared micro-batch a training forward belongs to (the
        accumulator's micro-step).

        Raises:
            ValueError: a forward beyond the window prepared (``hint``: how to feed it).
        """
        assert window is not None and self._acc is not None
        j = self._acc.micro_step
        if j >= window.size or window.done:
            raise ValueError(f"a forward of one more micro-batch than the {window.size} of the window "
                             f"LoadBalance prepared: a window that differs from the one prepared{hint}; "
                             "nothing has changed")
        return window, j

    def _before_step(self, window: PreparedWindow, j: int, info: Any) -> None:
        """A ``backward_pipeline`` call: first checked before anything changes (``info.items``
        None), then, right before its ``step()``, its weights."""
        if info.items is None:
            check_pipeline(self.mode, self.per_layer, info)
            if self._pipe is None:
                self._pipe = PipeTracker()
            self._pipe.wrap(info.stages)
            return
        assert self._pipe is not None
        self._pipe.feed(window, j, info, None if self._acc is None else self._acc.scaler)


def _pipelined(acc: Accumulator) -> bool:
    """``acc`` feeds (or may feed: a plain stage module under a pipeline's process group) a
    pipeline schedule through ``backward_pipeline``."""
    from gradaccum.torch.distributed.selector import PendingSync
    from gradaccum.torch.pipeline.sync import PipelineSync

    return isinstance(acc.grad_sync, (PendingSync, PipelineSync))


def _ordinary_buffers(model: nn.Module) -> None:
    """Replace a buffer made under ``inference_mode`` (a cache a module builds in its forward) by
    an ordinary copy: an inference tensor cannot be saved for a backward."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_inference():
                module._buffers[name] = buffer.clone()


def _distributed(model: nn.Module) -> bool:
    """DDP or FSDP2: a forward stopped half-way would leave their state mid-forward."""
    if type(model).__name__ == "DistributedDataParallel":
        return True
    return any(type(m).__name__.startswith("FSDP") for m in model.modules())
