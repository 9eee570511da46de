"""Window BatchNorm: running statistics updated once per window, as the full batch would.

In training each micro-batch is still normalized by its own mean and variance (that part of
BatchNorm depends on the batch by design and cannot be made exact without seeing the whole
batch), but the running statistics, which are what evaluation uses, are updated once per window
from the pooled count, mean and sum of squared deviations of all its micro-batches: exactly the
values one forward of the concatenated batch gives, the spread between micro-batch means
included (after torchgpipe's ``DeferredBatchNorm``).

The micro-batch statistics come out of the normalizing ``batch_norm`` call itself (scratch
running buffers with momentum 1 receive the batch mean and unbiased variance), so this costs no
extra pass over the activations. They are pooled in float64 with Chan's parallel formula, which
is stable where ``sum(x ** 2) - n * mean ** 2`` is not.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum.torch.accumulator import Accumulator
from gradaccum.torch.batchnorm.convert import (
    ConvertedNorm,
    adopt_state,
    check_initialized,
    is_batchnorm,
    swap_modules,
)

__all__ = ["Moments", "WindowBatchNorm", "merge_moments", "to_window_batchnorm", "window_batchnorm"]

# (count, per-channel mean, per-channel sum of squared deviations from the mean), float64
Moments = tuple[float, torch.Tensor, torch.Tensor]


def merge_moments(a: Moments, b: Moments) -> Moments:
    """Pool the moments of two disjoint sets of values (Chan et al.'s parallel formula).

    Example:
        >>> x = torch.arange(6.0, dtype=torch.float64)
        >>> def moments(v): return (v.numel(), v.mean(), ((v - v.mean()) ** 2).sum())
        >>> n, mean, m2 = merge_moments(moments(x[:2]), moments(x[2:]))
        >>> n, float(mean), float(m2) == float(moments(x)[2])
        (6, 2.5, True)
    """
    n_a, mean_a, m2_a = a
    n_b, mean_b, m2_b = b
    n = n_a + n_b
    delta = mean_b - mean_a.to(mean_b.device)
    mean = mean_a.to(mean_b.device) + delta * (n_b / n)
    m2 = m2_a.to(mean_b.device) + m2_b + delta.square() * (n_a * n_b / n)
    return n, mean, m2


class WindowBatchNorm(ConvertedNorm, _BatchNorm):
    """A BatchNorm whose running statistics are updated once per window, from the pooled window.

    Training forwards normalize with the micro-batch's statistics and add them to the window's
    pooled moments; :meth:`commit` (called at every window boundary by :func:`window_batchnorm`)
    updates ``running_mean``, ``running_var`` (unbiased) and ``num_batches_tracked`` (+1) once,
    as one forward of the whole window's batch would, ``momentum=None`` (cumulative average)
    included; :meth:`discard` drops a partial window. Evaluation and ``track_running_stats=False``
    behave exactly like a BatchNorm. Made by :func:`to_window_batchnorm`; it accepts 2-D to 5-D
    inputs ``(N, C, ...)`` like the BatchNorm it replaces, and ``revert()`` gives that back.

    The pending moments are plain attributes, not buffers: the ``state_dict`` stays a
    BatchNorm's, and a checkpoint taken in the middle of a window does not hold them (the resumed
    window's statistics then cover only its remaining micro-batches). Forwards repeated under
    activation checkpointing count twice, as they do for a plain BatchNorm.

    Args:
        bn: the BatchNorm to convert; its parameters and buffers are shared, not copied.
        sync: pool the moments over the ranks of ``process_group`` at :meth:`commit` (one
            ``all_gather`` per layer), so running statistics are those of the global batch, as
            under ``SyncBatchNorm``. Every rank must then commit at the same boundaries.
        process_group: the group to pool over (``None``: the default group).

    Attributes:
        track_running_stats: the converted BatchNorm's.
        sync: whether :meth:`commit` pools the moments over the ranks.
        process_group: the group pooled over (``None``: the default group).
    """

    def __init__(self, bn: _BatchNorm, *, sync: bool = False, process_group: Any = None) -> None:
        _BatchNorm.__init__(self, 1, bn.eps, bn.momentum, False, False)  # state adopted below
        self.num_features, self.affine = bn.num_features, bn.affine
        self.track_running_stats = bn.track_running_stats
        adopt_state(self, bn)
        self.sync = bool(sync)
        self.process_group = process_group
        self._pending: Moments | None = None
        self._remember(bn)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input``; in training, add its statistics to the window's moments."""
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        self._check_input_dim(input)
        assert self.running_mean is not None
        channels = input.shape[1]
        # momentum 1 writes the batch mean and unbiased variance into the scratch buffers.
        mean = torch.zeros(channels, dtype=self.running_mean.dtype, device=input.device)
        var = torch.ones_like(mean)
        out = F.batch_norm(input, mean, var, self.weight, self.bias, True, 1.0, self.eps)
        n = input.numel() // channels
        moments = (float(n), mean.double(), var.double() * (n - 1))
        self._pending = moments if self._pending is None else merge_moments(self._pending, moments)
        return out

    @property
    def pending_count(self) -> float:
        """Values per channel seen since the last commit (0 when none)."""
        return 0.0 if self._pending is None else self._pending[0]

    def discard(self) -> None:
        """Drop the window's pooled moments (the running statistics stay as they are)."""
        self._pending = None

    def commit(self) -> bool:
        """Update the running statistics once from the window's pooled moments, then reset them.

        Returns:
            True when the statistics changed (False: no training forward in this window).
        """
        pending, self._pending = self._pending, None
        if self.sync and dist.is_available() and dist.is_initialized():
            pending = self._pool_ranks(pending)
        if pending is None or not self.track_running_stats:
            return False
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        n, mean, m2 = pending
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        # In place and in PyTorch's order (momentum * batch + (1 - momentum) * running): DDP and
        # optimizers may hold these very tensors.
        for running, stat in ((self.running_mean, mean), (self.running_var, m2 / (n - 1))):
            running.copy_(stat.to(running.device) * factor + running.double() * (1.0 - factor))
        return True

    def _pool_ranks(self, pending: Moments | None) -> Moments | None:
        assert self.running_mean is not None
        c = self.num_features
        local = torch.zeros(2 * c + 1, dtype=torch.float64, device=self.running_mean.device)
        if pending is not None:
            local[0], local[1:c + 1], local[c + 1:] = pending[0], pending[1], pending[2]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.process_group))]
        dist.all_gather(parts, local, group=self.process_group)
        pooled: Moments | None = None
        for part in parts:
            count = float(part[0])
            if count > 0:
                moments = (count, part[1:c + 1], part[c + 1:])
                pooled = moments if pooled is None else merge_moments(pooled, moments)
        return pooled

    def revert(self) -> nn.Module:
        """The original BatchNorm, holding this layer's parameters and running statistics."""
        return adopt_state(self._source(), self)

    def extra_repr(self) -> str:
        """The BatchNorm's settings in ``repr(module)``, and ``sync``."""
        return f"{_BatchNorm.extra_repr(self)}, sync={self.sync}"  # type: ignore[no-untyped-call]


def to_window_batchnorm(model: nn.Module, *, sync: bool | None = None,
                        process_group: Any = None) -> nn.Module:
    """Replace every BatchNorm of ``model`` by a :class:`WindowBatchNorm` sharing its state.

    Args:
        model: the model (children are replaced in place; a BatchNorm root is returned anew).
        sync: pool statistics over ranks at each commit. ``None``: pool for layers converted from
            a ``SyncBatchNorm`` (over its group), not for the others.
        process_group: the group to pool over when ``sync`` is true (``None``: the layer's
            ``SyncBatchNorm`` group, else the default group).

    Returns:
        The model (use the returned object: the root itself may have been a BatchNorm).

    Raises:
        ValueError: a lazy BatchNorm is uninitialized (raised before anything changes).
    """
    for name, module in model.named_modules():
        if is_batchnorm(module):
            assert isinstance(module, _BatchNorm)
            check_initialized(name, module)

    def convert(name: str, module: nn.Module) -> nn.Module | None:
        if not is_batchnorm(module):
            return None
        assert isinstance(module, _BatchNorm)
        is_sync = isinstance(module, nn.SyncBatchNorm)
        group = process_group
        if group is None and isinstance(module, nn.SyncBatchNorm):
            group = module.process_group
        return WindowBatchNorm(module, sync=is_sync if sync is None else sync, process_group=group)

    return swap_modules(model, convert)


def window_batchnorm(model: nn.Module, accumulator: Accumulator, *, sync: bool | None = None,
                     process_group: Any = None) -> nn.Module:
    """Convert ``model``'s BatchNorms to :class:`WindowBatchNorm`, committed by ``accumulator``.

    Every window boundary (stepped, skipped or flushed) commits the pooled statistics, so after
    each optimizer step the running statistics equal a full-batch run's (given the same running
    statistics before the window); :meth:`Accumulator.discard` drops them. Convert when the
    accumulator is at a window boundary; :func:`gradaccum.torch.batchnorm.restore_batchnorm`
    turns the layers back (the hooks then have nothing to do).

    Args:
        model: the model, before or after wrapping in ``DistributedDataParallel``.
        accumulator: the :class:`Accumulator` whose boundaries commit the statistics.
        sync: as in :func:`to_window_batchnorm`.
        process_group: as in :func:`to_window_batchnorm`.

    Returns:
        The model (use the returned object: the root itself may have been a BatchNorm).

    Raises:
        ValueError: the accumulator is in the middle of a window, or a lazy BatchNorm is
            uninitialized; raised before anything changes.

    Example:
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        >>> acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
        >>> model = window_batchnorm(model, acc)
        >>> for xb in torch.randn(8, 3).split(4):
        ...     stepped = acc.backward(model(xb).pow(2).mean())
        >>> int(model[1].num_batches_tracked)
        1
    """
    if accumulator.micro_step != 0:
        raise ValueError("convert at a window boundary: the accumulator is at micro_step "
                         f"{accumulator.micro_step}")
    model = to_window_batchnorm(model, sync=sync, process_group=process_group)
    layers = [m for m in model.modules() if isinstance(m, WindowBatchNorm)]

    def commit(_: Accumulator) -> None:
        for layer in layers:
            layer.commit()

    def discard(_: Accumulator) -> None:
        for layer in layers:
            layer.discard()

    accumulator.register_boundary_hook(commit)
    accumulator.register_discard_hook(discard)
    return model
