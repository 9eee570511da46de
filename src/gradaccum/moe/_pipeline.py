"""A :class:`gradaccum.moe.LoadBalance` under ``Accumulator.backward_pipeline``: each stage's
balancing gradient in its own backward, per pipeline micro-batch (docs/MOE.md, "Pipeline").

A pipeline schedule splits each ``step()``'s batch into its ``n_microbatches`` pipeline
micro-batches (``torch.tensor_split`` along dim 0) and runs their forwards and backwards inside
``step()``, interleaved. So the unit of the one-pass modes is the pipeline micro-batch (what one
forward of the model sees), in the window's order ``(call, chunk)``:

* ``"micro_batch"``: each pipeline micro-batch's own loss, weighted by its share of the window's
  masked tokens;
* ``"rolling"``: ``f`` from the routes of the window's pipeline micro-batches up to this one, this
  one included (on a stage, a chunk's backward always follows the forwards of the chunks before it).

Each stage counts only its own routers (its layers), so only ``per_layer=True`` is exact without
a collective inside the schedule; ``"global"`` needs a pre-pass of the whole window and is refused,
as are data-parallel replicas of a stage (their counts would need an all-reduce per pipeline
micro-batch, inside the backward). :class:`PipeTracker` wraps each stage's ``forward_one_chunk``
and ``backward_one_chunk`` (the chunk being run) and ``_prepare_forward_infra`` (the schedule's
metadata inference: a forward of a real micro-batch at its first call, which no call trains on:
not counted).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradaccum.moe._inject import Site, count_routes, inject
from gradaccum.moe._window import PreparedWindow

__all__ = ["PipeTracker", "check_pipeline"]


def check_pipeline(mode: str, per_layer: bool, info: Any) -> None:
    """Refuse, before anything changes and on every rank alike, what is not supported.

    Raises:
        ValueError: ``mode="global"`` or ``per_layer=False``.
        NotImplementedError: data-parallel replicas of a pipeline stage.
    """
    if mode == "global":
        raise ValueError(
            "LoadBalance(mode='global') under backward_pipeline: its pre-pass would need a "
            "forward-only run of the schedule over the whole window; use mode='rolling' (the routes "
            "so far in the window) or mode='micro_batch' (each pipeline micro-batch's own loss), "
            "exact under 1F1B and Interleaved1F1B, or the two-pass recipe by hand of docs/MOE.md; "
            "nothing has changed")
    if not per_layer:
        raise ValueError(
            "LoadBalance(per_layer=False) under backward_pipeline: the pooled loss needs every "
            "stage's route counts in each stage's backward; use per_layer=True (each layer's loss "
            "summed: Switch, Megatron, torchtitan), which each stage computes from its own routers; "
            "nothing has changed")
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    replicated = any(isinstance(s.submod, (DistributedDataParallel, FSDPModule)) for s in info.stages)
    pp = dist.get_world_size(info.stages[0].group) if dist.is_initialized() else 1
    if replicated or (dist.is_initialized() and dist.get_world_size() != pp):
        raise NotImplementedError(
            "LoadBalance under backward_pipeline with data-parallel replicas of a stage: a stage's "
            "route counts would need an all-reduce over its replicas inside the schedule's backward; "
            "supported: one replica per stage (the pipeline's process group is the whole world); "
            "nothing has changed")


class _ChunkSlot:
    """The slot of one pipeline micro-batch: its weights ``a`` computed at its first backward
    (every route they need is counted by then), its ``weight`` set by the call's feed."""

    def __init__(self, pipe: PipeTracker, window: PreparedWindow, key: tuple[int, int], weight: Any) -> None:
        self._pipe, self._window, self._key, self.weight = pipe, window, key, weight
        self._a: torch.Tensor | None = None

    @property
    def a(self) -> torch.Tensor:
        if self._a is None:
            self._a = self._pipe.weights(self._window, self._key)
        return self._a


class PipeTracker:
    """One LoadBalance's pipeline state: the chunk its stages run, and each pipeline micro-batch's
    routes, tokens and slot in the current window."""

    def __init__(self) -> None:
        self.chunk: int | None = None  # the pipeline micro-batch a stage's forward runs
        self.inferring = False  # the schedule's metadata inference
        self.n_microbatches = 1
        self.weight: dict[int, Any] = {}  # call -> the balancing gradient's factor
        self.routes: dict[tuple[int, int], torch.Tensor] = {}
        self.tokens: dict[tuple[int, int], float] = {}
        self.slots: dict[tuple[int, int], _ChunkSlot] = {}
        self.owner: PreparedWindow | None = None
        self._wrapped: set[int] = set()

    def wrap(self, stages: Any) -> None:
        """Wrap each stage's ``forward_one_chunk`` and ``backward_one_chunk`` (the chunk they run:
        a checkpoint recomputes the router in the backward) and ``_prepare_forward_infra`` (once)."""
        for stage in stages:
            if id(stage) in self._wrapped:
                continue
            self._wrapped.add(id(stage))
            for name in ("forward_one_chunk", "backward_one_chunk"):
                setattr(stage, name, self._running(getattr(stage, name)))
            infer = stage._prepare_forward_infra

            def prepare(*args: Any, infer: Any = infer, **kwargs: Any) -> Any:
                self.inferring = True
                try:
                    return infer(*args, **kwargs)
                finally:
                    self.inferring = False
            stage._prepare_forward_infra = prepare

    def _running(self, method: Any) -> Any:
        def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
            outer, self.chunk = self.chunk, int(chunk)
            try:
                return method(chunk, *args, **kwargs)
            finally:
                self.chunk = outer
        return run

    def feed(self, window: PreparedWindow, j: int, info: Any, scaler: Any) -> None:
        """Before call ``j``'s ``step()``: the factor that makes its balancing gradient weigh 1
        after the pipeline boundary's normalization (torch/pipeline/boundary.py): ``T / P`` for an
        item-weighted window (``T`` its items over every call, from windows()'s count function),
        ``calls / steps`` for a mean one.

        Raises:
            ValueError: an item-weighted window and windows() was given no ``n_items=``.
        """
        if self.owner is not window:
            self.owner, self.weight, self.routes, self.tokens, self.slots = window, {}, {}, {}, {}
        self.n_microbatches = info.n_microbatches
        if info.items:
            if window.items is None:
                raise ValueError(
                    "backward_pipeline(..., n_items=...) weighs the window by items, but "
                    "balance.windows() was given no n_items=: pass, on every rank, the count function "
                    "of a whole batch, e.g. n_items=lambda batch: gradaccum.count_tokens(labels_of(batch))")
            weight: Any = window.items / (info.scale or 1.0)
        else:
            weight = window.size / info.steps
        if scaler is not None and scaler.is_enabled():
            weight = scaler.scale(torch.as_tensor(weight, dtype=torch.float64))
        self.weight[j] = weight

    def _mask(self, window: PreparedWindow, j: int, c: int, rows: int) -> torch.Tensor:
        mask, lead = window.masks[j], window.leads[j]
        assert mask is not None  # the one-pass modes need masks (windows() checked)
        chunk = torch.tensor_split(mask.view(lead, -1), self.n_microbatches, 0)[c].reshape(-1)
        if chunk.numel() != rows:
            raise ValueError(f"the mask of pipeline micro-batch {c} of call {j} has {chunk.numel()} "
                             f"tokens but its router routed {rows} rows: mask= must give one value per "
                             "routed token, its dim 0 the batch's (split as the schedule splits it)")
        return chunk

    def router(self, window: PreparedWindow, j: int, layer: int, rows: torch.Tensor, top_k: int,
               counted: bool, output: Any, logits: torch.Tensor) -> Any:
        """One router call of pipeline micro-batch ``self.chunk`` of call ``j``: count its routes
        (``counted``: not a checkpoint's recomputation) and enter its balancing gradient."""
        c = self.chunk
        assert c is not None
        key = (j, c)
        mask = self._mask(window, j, c, rows.shape[0])
        if counted:
            routes = count_routes(rows, mask, top_k)
            if key not in self.routes:
                self.routes[key] = torch.zeros(window.layers, routes.numel(), dtype=routes.dtype,
                                               device=routes.device)
                self.tokens[key] = float(mask.sum())
            self.routes[key][layer] += routes
            window.add_routes(window.seen_routes, j, layer, routes)  # the window's load
        if not torch.is_grad_enabled():
            return None
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = _ChunkSlot(self, window, key, self.weight[j])
        return inject(output, logits, Site(rows.detach(), mask, layer, slot))  # type: ignore[arg-type]

    def weights(self, window: PreparedWindow, key: tuple[int, int]) -> torch.Tensor:
        """The weights ``a`` of pipeline micro-batch ``key``: from its own routes
        (``"micro_batch"``) or from those of the window's pipeline micro-batches up to it."""
        if window.mode == "micro_batch":
            return window.weigh(self.routes[key], self.tokens[key])
        keys = [k for k in self.routes if k <= key]
        counts = sum((self.routes[k] for k in keys[1:]), self.routes[keys[0]])
        return window.weigh(counts, sum(self.tokens[k] for k in keys))
