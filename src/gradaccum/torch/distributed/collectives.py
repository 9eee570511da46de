"""The base of the distributed syncs: the few collectives they need, over the data-parallel ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradaccum.torch._weights import wide_dtype
from gradaccum.torch.distributed.base import SyncMode, agree_on_count, check_sync_mode

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["RankGroups"]


class RankGroups:
    """Collectives over the process groups that together span the data-parallel ranks.

    A 1-D layout has one group; an FSDP2 mesh has one per dimension, and reducing over each in
    turn reduces over the whole mesh. Subclasses add ``prepare`` and ``sync_partial``.

    Args:
        groups: the process groups.
        device: where the small reduction tensors live (the parameters' device).
        mode: ``"window"`` or ``"micro_batch"``.
    """

    def __init__(self, groups: Sequence[ProcessGroup], device: torch.device, mode: SyncMode) -> None:
        self.groups = list(groups)
        self.device = device
        self.mode = check_sync_mode(mode)
        self.world_size = math.prod(dist.get_world_size(g) for g in self.groups)
        self.problems: list[str] = []  # this window's guard refusals on this rank (defer)
        self._flagged: Any = None  # the ranks that deferred one, as reduced at the boundary
        self._deferred: list[str] = []

    def defer(self, message: str) -> None:
        """A guard's refusal on this rank alone (an edited or stale gradient, a scheduler stepped
        outside), kept for the window's boundary: :meth:`reduce_window` tells every rank, and
        :meth:`raise_deferred` raises it on every rank together. Raised here, it would leave the
        other ranks waiting in the window's gradient reduction until the process group's timeout."""
        self.problems.append(message)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> None:
        for group in self.groups:
            dist.all_reduce(tensor, op=op, group=group)

    def reduce_window(self, loss_sum: Any, items: Any,
                      sums: Sequence[Any] = ()) -> tuple[Any, Any, list[Any]]:
        """Average the loss sum and the item total over ranks, and sum ``sums`` (the window's
        ``mb.term`` counts and totals), in a single all-reduce.

        Gradients are averaged over ranks (DDP and FSDP2 divide by the world size), so the
        averaged item total is the divisor that turns them into the global item-weighted mean.
        A rank that deferred a refusal in this window sends NaN as its loss sum, so the reduced
        loss sum is NaN on every rank (read by :meth:`raise_deferred`): no slot more (on gloo, a
        second element costs a fifth more time than one).
        """
        present = [v for v in (loss_sum, items) if v is not None]
        self._deferred, self.problems = self.problems, []
        if not present and not sums:
            return loss_sum, items, []
        dtype = wide_dtype(self.device, torch.float32)
        values = [torch.as_tensor(v, device=self.device).reshape(()).to(dtype) for v in (*present, *sums)]
        if self._deferred:
            values[0] = torch.full((), math.nan, dtype=dtype, device=self.device)
        vec = torch.stack(values)
        self.all_reduce(vec)
        self._flagged = vec[0]
        averaged = (vec[: len(present)] / self.world_size).unbind()
        out = iter(averaged)
        loss = None if loss_sum is None else next(out)
        if isinstance(loss_sum, torch.Tensor) and loss is not None:
            loss = loss.to(loss_sum.dtype)
        return loss, None if items is None else next(out), list(vec[len(present):].unbind())

    def raise_deferred(self) -> None:
        """At the boundary, after :meth:`reduce_window`: raise on every rank if any rank deferred
        a refusal in this window. One host read per window (is the reduced loss sum NaN?); only
        when it is, the ranks agree whether a rank deferred one (or the loss itself is NaN: the
        window then goes on) and send the first such rank's message to every rank, so all raise
        the same error.

        Raises:
            RuntimeError: a rank's guard refused the window; the accumulator drops it.
        """
        flagged, self._flagged = self._flagged, None
        mine, self._deferred = self._deferred, []
        if flagged is None or not math.isnan(flagged.item()):
            return
        if not self.max_over_ranks([int(bool(mine))])[0]:
            return  # the window's loss is NaN: skip_nonfinite or the scaler decide, as ever
        try:
            said = [(rank, msgs) for rank, msgs in enumerate(self.gather_objects(mine)) if msgs]
        except ValueError:  # several process groups (a 2-D mesh): only this rank's own, if any
            said = [(dist.get_rank(), mine)] if mine else []
        where = "rank(s) " + ", ".join(str(rank) for rank, _ in said) if said else "another rank"
        what = said[0][1][0] if said else "a guard refused this window on another rank (see its error)"
        raise RuntimeError(
            f"{what} [{where}; raised on every rank at the window's boundary, where the window "
            "is dropped on every rank (its gradients cleared): raised on one rank alone, it would "
            "have left the others waiting in the gradient reduction]")

    def agree_count(self, count: Any) -> Any:
        """The largest ``count`` of any rank, as a tensor on the ranks' device (one MAX all-reduce
        of 8 bytes, no host read). The accumulator asks once per run: the first window's
        provisional total must be the same on every rank, and no earlier window gives one."""
        vec = torch.as_tensor(count, device=self.device).reshape(()).to(
            wide_dtype(self.device, torch.float32), copy=True)
        self.all_reduce(vec, op=dist.ReduceOp.MAX)
        return vec

    def agree_on_length(self, micro_steps: int, has_grad: Sequence[bool] = ()) -> list[bool] | None:
        """One MAX all-reduce of ``[has_grad..., r, -r]`` before a flushed window is reduced.

        Returns:
            For each entry of ``has_grad``, whether any rank has that gradient; ``None`` when the
            window is empty on every rank (nothing to reduce).

        Raises:
            ValueError: the ranks hold windows of different lengths. Every rank sees the same
                reduced values, so every rank raises (none is left waiting in a collective).
        """
        anyone, shortest, longest = agree_on_count(self, micro_steps, has_grad)
        if longest != shortest:
            raise ValueError(
                f"flush(): the ranks hold partial windows of different lengths (from "
                f"{shortest} to {longest} micro-batches); every rank must feed the same "
                "number of micro-batches per window, as DDP and FSDP require (a DistributedSampler "
                "gives every rank the same number of batches)"
            )
        return None if longest == 0 else anyone

    def average_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Average ``tensors`` over the ranks in place: flattened per dtype, one all-reduce each,
        in the tensors' own dtype (float32 buffers are reduced in float32)."""
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t)
        for group in groups.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self.all_reduce(flat)
            flat.div_(self.world_size)
            for t, synced in zip(group, torch.split(flat, [t.numel() for t in group]), strict=True):
                t.copy_(synced.view_as(t))

    @property
    def rank(self) -> int:
        """This process's rank among the data-parallel ranks (of :meth:`gather_objects`)."""
        return int(dist.get_rank(self._single_group()))

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small and picklable), in rank order (``all_gather_object``).

        Raises:
            ValueError: the ranks span several process groups (an FSDP2 mesh of more than one
                dimension), whose rank order one gather cannot give.
        """
        group = self._single_group()
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def gather_rows(self, tensor: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order, where rank ``r`` holds
        ``rows[r]`` rows (ranks may differ: each is padded to the largest for the collective).
        The result is a new tensor without grad; a bool tensor travels as uint8."""
        group = self._single_group()
        send = tensor.detach()
        wire = torch.uint8 if send.dtype == torch.bool else send.dtype
        longest = max(rows)
        padded = send.new_zeros((longest, *send.shape[1:]), dtype=wire)
        padded[: send.shape[0]] = send
        parts = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, rows, strict=True)]).to(send.dtype)

    def _single_group(self) -> Any:
        if len(self.groups) != 1:
            raise ValueError(f"backward_cached gathers representations over one process group; these "
                             f"ranks span {len(self.groups)} (a multi-dimensional FSDP2 mesh): "
                             "shard over a 1-D mesh")
        return self.groups[0]

    def max_over_ranks(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of ``values`` over every data-parallel rank (one MAX
        all-reduce per process group)."""
        vec = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        self.all_reduce(vec, op=dist.ReduceOp.MAX)
        return [int(v) for v in vec.tolist()]

    def check_saveable(self) -> None:
        """Partial gradients are in ``.grad`` (each rank saves its own accumulator state)."""

    def watch_forward(self, module: torch.nn.Module) -> None:
        """Note every forward through ``module`` (the wrapper whose forward arms the gradient sync)."""
        self.module_name = type(module).__name__
        self.forward_ran = False
        module.register_forward_pre_hook(self._saw_forward)

    def _saw_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.forward_ran = True

    def check_forward(self) -> None:
        """Raise if no forward ran through the wrapper since the last boundary.

        A forward through the unwrapped module (``ddp_model.module``) arms no gradient sync:
        the ranks would step on their own gradients and drift apart without a word.

        Raises:
            RuntimeError: no forward ran through the wrapper in this window.
        """
        if not self.forward_ran:
            raise RuntimeError(
                f"no forward ran through model= (the {self.module_name}) in this window, so no "
                "gradients were averaged across ranks: call the wrapped model you passed as "
                "model=, not its .module or the model it wraps")
        self.forward_ran = False

    def discard(self) -> None:
        """Nothing is held outside ``.grad``; the window's deferred refusals go with it."""
        self.problems = []
