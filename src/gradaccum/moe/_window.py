"""One window of a :class:`gradaccum.moe.LoadBalance` run: its micro-batches, masks and totals, the
routes counted in it, and the weights each micro-batch's backward carries.

:class:`PreparedWindow` is made by ``LoadBalance.windows`` before the window trains (with mode
``"global"``, after the pre-pass counted its routes) and dropped at its boundary. The router
hooks add the routes of each training forward to it (:meth:`PreparedWindow.seen`), and the
accumulator's feed hook asks it for the slot of a micro-batch (:meth:`PreparedWindow.fill`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from gradaccum.core.balance import count_scale
from gradaccum.moe._inject import Slot, add_routes
from gradaccum.torch.cached.replay import RngStates

__all__ = ["Batches", "PreparedWindow", "all_reduce_sum", "mask_rows"]


class Batches(list):  # type: ignore[type-arg]
    """The window's micro-batches, a list; iterating it puts back, before each micro-batch, the
    random state its pre-pass forward ran from (so the training forward routes as counted)."""

    def __init__(self, batches: list[Any], states: list[RngStates] | None) -> None:
        super().__init__(batches)
        self._states = states

    def __iter__(self) -> Iterator[Any]:
        for j, batch in enumerate(list.__iter__(self)):
            if self._states is not None and j < len(self._states):
                self._states[j].restore()
            yield batch


def all_reduce_sum(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """``t`` summed over the ranks (one all-reduce; nothing on one process)."""
    if world_size > 1:
        torch.distributed.all_reduce(t)
    return t


class PreparedWindow:
    """A window read before it trains.

    Args:
        size: its micro-batches.
        masks: each micro-batch's row mask (float64, flattened), or None (every row counts).
        shape: ``(layers, experts, top_k, per_layer, coef, mode)`` (experts None: read from
            the first routes counted).
        world_size: the ranks.
    """

    def __init__(self, size: int, masks: list[torch.Tensor | None], shape: tuple[Any, ...],
                 world_size: int) -> None:
        self.size = size
        self.masks = masks
        self.layers, self.experts, self.top_k, self.per_layer, self.coef, self.mode = shape
        # made once per window, not once per router call: each route's weight (the row mask
        # repeated top_k times) and the mask as a column (the closed-form gradient's rows)
        self.route_weights = [None if m is None else m.repeat_interleave(self.top_k) for m in masks]
        self.mask_cols = [None if m is None else m.unsqueeze(-1) for m in masks]
        self.world_size = world_size
        self.slots = [Slot() for _ in range(size)]
        self.counts: list[torch.Tensor | None] = [None] * size  # pre-pass routes per micro-batch
        self.rows: list[Any] = [None] * size  # each micro-batch's tokens on this rank
        self.leads: list[int] = [1] * size  # each mask's dim 0 (a pipeline splits the batch along it)
        self.seen_routes: list[torch.Tensor | None] = [None] * size  # training forwards' routes
        self.window_tokens: Any = None  # over every rank
        self.items: Any = None  # the n_items total over every rank (None: no count function)
        self.items_local: list[Any] = []
        self.weights: torch.Tensor | None = None  # "global": the window's a
        self._cum: torch.Tensor | None = None  # "rolling": routes so far, every rank
        self._cum_tokens: Any = 0
        self.load: torch.Tensor | None = None
        self.fed_items: Any = 0  # the n_items the user's backward calls gave (checked at the end)
        self.done = False  # the accumulator applied the window (its boundary hook)
        self._counted: set[int] = set()  # micro-batches whose n_items were added to fed_items

    # ------------------------------------------------------------------ counts
    def add_routes(self, store: list[torch.Tensor | None], j: int, layer: int, routes: torch.Tensor) -> None:
        """Add one router call's routes to micro-batch ``j``'s in ``store`` (:attr:`counts`, the
        pre-pass's, or :attr:`seen_routes`, the training forwards')."""
        self._store(store, j, routes)[layer] += routes

    def count(self, store: list[torch.Tensor | None], j: int, layer: int, rows: torch.Tensor) -> None:
        """Count one router call's routes (its detached logits ``rows``, rows by experts) into
        micro-batch ``j``'s in ``store``, in place (a top-k and an ``index_add_``)."""
        if self.experts is None:
            self.experts = rows.shape[-1]
        add_routes(rows, self.route_weights[j], self.top_k, self._store(store, j, rows)[layer])

    def _store(self, store: list[torch.Tensor | None], j: int, like: torch.Tensor) -> torch.Tensor:
        if self.experts is None:
            self.experts = like.shape[-1]
        counts = store[j]
        if counts is None:
            counts = torch.zeros(self.layers, self.experts, dtype=torch.float64, device=like.device)
            store[j] = counts
        return counts

    def _zeros(self, like: torch.Tensor | None) -> torch.Tensor:
        device = like.device if like is not None else None
        return torch.zeros(self.layers, self.experts, dtype=torch.float64, device=device)

    def weigh(self, counts: torch.Tensor, counted_tokens: Any) -> torch.Tensor:
        """The weights ``a`` from route counts taken over ``counted_tokens`` tokens."""
        scale = count_scale(max(counted_tokens, 1), max(self.window_tokens, 1), layers=self.layers,
                            experts=self.experts, top_k=self.top_k, per_layer=self.per_layer,
                            coef=self.coef)
        pooled = counts if self.per_layer else counts.sum(0, keepdim=True).expand_as(counts)
        weights: torch.Tensor = pooled * scale
        return weights

    def finish_prepare(self, items_local: list[Any] | None) -> None:
        """After the pre-pass (or, in the one-pass modes, the masks alone): one all-reduce of the
        routes (``"global"``), tokens and items, then the window's weights (``"global"``)."""
        rows = [float(r) for r in self.rows]
        parts = [torch.tensor([sum(rows)], dtype=torch.float64)]
        if items_local is not None:
            self.items_local = items_local
            total = sum((torch.as_tensor(n, dtype=torch.float64).reshape(1).cpu() for n in items_local),
                        torch.zeros(1, dtype=torch.float64))
            parts.append(total)
        device = None
        if self.mode == "global":
            counts = [c for c in self.counts if c is not None]
            local = sum(counts[1:], counts[0]) if counts else self._zeros(None)
            device = local.device
            parts.append(local.reshape(-1).cpu())
        flat = torch.cat(parts)
        if self.world_size > 1:
            flat = flat.to(_collective_device())
        flat = all_reduce_sum(flat, self.world_size).cpu()
        self.window_tokens = float(flat[0])
        if items_local is not None:
            self.items = float(flat[1])
        if self.mode == "global":
            load = flat[-self.layers * self.experts:].reshape(self.layers, self.experts).to(device)
            self.load = load
            self.weights = self.weigh(load, self.window_tokens)

    # ------------------------------------------------------------------ a micro-batch's backward
    def fill(self, j: int) -> Slot:
        """The slot of micro-batch ``j``, its weights computed at its first backward.

        Raises:
            ValueError: ``"global"``: its training forward routed otherwise than the pre-pass
                counted (another batch, another model state); before any backward of it.
        """
        slot = self.slots[j]
        if slot.a is not None:
            return slot
        seen = self.seen_routes[j]
        if self.mode == "global":
            prepared = self.counts[j]
            if seen is None or prepared is None or not torch.equal(seen, prepared.to(seen.device)):
                raise ValueError(
                    f"micro-batch {j} of this window routed otherwise than the window LoadBalance "
                    "prepared (the pre-pass counted its routes): feed the window's micro-batches as "
                    "windows() gives them, in order, each through one forward, and change no "
                    "parameter or routing bias inside the window; nothing has changed")
            assert self.weights is not None
            slot.a = self.weights
        elif self.mode == "rolling":
            routes = seen if seen is not None else self._zeros(None)
            tokens = float(self.rows[j] or 0)
            if self.world_size > 1:  # this micro-batch's routes and tokens on every rank: one all-reduce
                both = torch.cat([routes.reshape(-1).cpu(), torch.tensor([tokens], dtype=torch.float64)])
                both = all_reduce_sum(both.to(_collective_device()), self.world_size).cpu()
                routes, tokens = both[:-1].reshape(routes.shape).to(routes.device), float(both[-1])
            self._cum = routes if self._cum is None else self._cum + routes
            self._cum_tokens = self._cum_tokens + tokens
            slot.a = self.weigh(self._cum, self._cum_tokens)
        else:
            counts = seen if seen is not None else self._zeros(None)
            slot.a = self.weigh(counts, float(self.rows[j] or 0))
        return slot

    def weight(self, feed: Any, scaler: Any) -> Any:
        """What micro-batch ``feed.micro_step``'s closed-form gradient is multiplied by so that,
        after the boundary's normalization and the ranks' average, it weighs exactly 1
        (torch/_weights.py): the backward's seed times the window's total over its count (the
        mean weighting's total: micro-batches times ranks), times an active scaler's scale.

        Raises:
            ValueError: an item-weighted backward, and no count function given to windows().
        """
        seed = 1.0 if feed.seed is None else feed.seed
        if feed.n_items is None:
            weight = seed * (self.size * self.world_size)
        else:
            if self.items is None:
                raise ValueError(
                    f"acc.backward(..., n_items={feed.n_items!r}) weighs the window by items, but "
                    "balance.windows() was given no n_items=: pass the count function, e.g. "
                    "n_items=lambda batch: gradaccum.count_tokens(batch['labels'], shift=True); "
                    "nothing has changed")
            n = feed.n_items
            if feed.micro_step not in self._counted:  # a micro_batch() block's backwards count once
                self._counted.add(feed.micro_step)
                self.fed_items = self.fed_items + (n.detach().to(torch.float64) if isinstance(n, torch.Tensor)
                                                   else float(n))
            weight = seed * self.items if feed.reduction == "sum" else seed * self.items / n
        if scaler is not None and scaler.is_enabled():
            weight = scaler.scale(torch.as_tensor(weight, dtype=torch.float64))
        return weight

    def check_items(self) -> None:
        """At the window's end: the ``n_items`` the backward calls gave are what windows()'s count
        function counted (this rank's; one host read per window).

        Raises:
            ValueError: they differ: the balancing gradient's weight used the wrong total.
        """
        if self.items is None or not self.items_local or not self._counted:
            return
        given = float(self.fed_items)
        expected = float(torch.stack([torch.as_tensor(n, dtype=torch.float64).reshape(()).cpu()
                                      for n in self.items_local]).sum())
        if abs(given - expected) > 1e-9 * max(expected, 1.0):
            raise ValueError(f"the n_items given to acc.backward sum to {given:g} on this rank but "
                             f"balance.windows(n_items=...) counts {expected:g}: give windows() the count "
                             "function your backward uses")

    def close(self) -> torch.Tensor:
        """The window's load (routes per layer and expert, every rank), at its boundary."""
        if self.mode == "global":
            assert self.load is not None
            return self.load
        if self.mode == "rolling" and self._cum is not None:
            return self._cum
        seen = [s for s in self.seen_routes if s is not None]
        local = sum(seen[1:], seen[0]) if seen else self._zeros(None)
        if self.world_size > 1:
            device = local.device
            local = all_reduce_sum(local.to(_collective_device()), self.world_size).to(device)
        return local


def _collective_device() -> torch.device:
    """The device the default process group's collectives take (CPU for gloo)."""
    backend = torch.distributed.get_backend()
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mask_rows(mask: Any) -> torch.Tensor | None:
    """A batch's mask as float64 rows (flattened), or None."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must give a tensor (the batch's token mask), got {type(mask).__name__}")
    return mask.detach().reshape(-1).to(torch.float64)

