"""What a second forward of the same chunk must see and must not change (``backward_cached``).

The second pass re-runs each chunk to rebuild its graph. It must draw the same random numbers as
the first (dropout masks), which :class:`RngStates` replays, as ``torch.utils.checkpoint`` does:
the CPU generator and every initialized CUDA device's. And a forward in training mode changes
state that a single forward of the batch would change once: BatchNorm's running statistics (and
gradaccum's window BatchNorm's pending moments). :class:`NormStats` saves them before the first
pass and puts them back after it, so that only the second pass's update stays.

:func:`params_read` replays one chunk's forward once more to see which parameters it reads: for
the one case the outputs cannot tell (none requires grad while parameters the loss does not use
train), whether ``encode`` detached what it computed from them, or never used them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from gradaccum.torch._grads import graph_nodes

__all__ = ["NormStats", "RngStates", "params_read", "untracked_batchnorm"]

_RUNNING = ("running_mean", "running_var", "num_batches_tracked")


class RngStates:
    """The random generators' states: the CPU's and those of the CUDA devices in use.

    Example:
        >>> states = RngStates.capture()
        >>> a = torch.rand(2)
        >>> states.restore()
        >>> torch.equal(torch.rand(2), a)
        True
    """

    def __init__(self, cpu: torch.Tensor, cuda: list[torch.Tensor] | None) -> None:
        self.cpu = cpu
        self.cuda = cuda

    @classmethod
    def capture(cls) -> RngStates:
        """The states now. CUDA's only once CUDA is initialized: a process that never touched a
        device has no device generator in use (and is not made to initialize one)."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        """Set every generator back to these states."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


class NormStats:
    """A copy of the running statistics of every normalization layer of ``model`` (BatchNorm,
    SyncBatchNorm, InstanceNorm with ``track_running_stats``, gradaccum's window BatchNorm).

    Args:
        model: the module whose layers to save, or None (nothing is saved).
    """

    def __init__(self, model: nn.Module | None) -> None:
        self.saved: list[tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]], Any]] = []
        for module in () if model is None else model.modules():
            if not isinstance(module, _NormBase):
                continue
            buffers = [getattr(module, name) for name in _RUNNING]
            pairs = [(b, b.detach().clone()) for b in buffers
                     if isinstance(b, torch.Tensor) and not isinstance(b, nn.parameter.UninitializedBuffer)]
            if pairs or hasattr(module, "_pending"):
                self.saved.append((module, pairs, getattr(module, "_pending", None)))

    def restore(self) -> None:
        """Put the saved statistics back, in place (DDP may hold these very tensors)."""
        with torch.no_grad():
            for module, pairs, pending in self.saved:
                for live, copy in pairs:
                    live.copy_(copy)
                if hasattr(module, "_pending"):
                    module._pending = pending

    def covers(self, running_mean: torch.Tensor) -> bool:
        """True when ``running_mean`` (a tensor a BatchNorm updated) is one of the saved ones."""
        ptr = running_mean.data_ptr()
        return any(live.data_ptr() == ptr for _, pairs, _ in self.saved for live, _ in pairs)


def untracked_batchnorm(outputs: list[torch.Tensor], stats: NormStats) -> bool:
    """True when the graph of ``outputs`` holds a BatchNorm in training mode whose running
    statistics ``stats`` did not save: it would update them once per pass, twice per chunk.

    Walks the autograd graph once (``backward_cached`` does it on its first call only).
    """
    for node in graph_nodes(t.grad_fn for t in outputs):
        if "BatchNorm" in type(node).__name__ and getattr(node, "_saved_training", False):
            running = getattr(node, "_saved_running_mean", None)
            if isinstance(running, torch.Tensor) and not stats.covers(running):
                return True
    return False


class _Reads(TorchFunctionMode):
    """Notes which of some tensors any torch function is called with."""

    def __init__(self, watched: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.watched = {id(t): t for t in watched}
        self.read: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if id(leaf) in self.watched:
                self.read[id(leaf)] = leaf
        return func(*args, **kwargs)


def params_read(forward: Callable[[], Any], rng: RngStates, model: nn.Module | None,
                params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of ``params`` that ``forward()`` passes to a torch function (a module's
    ``F.linear(x, self.weight, ...)``, with or without grad), found by running it once more
    under ``torch.no_grad()``: with ``rng`` replayed, and the random state and ``model``'s
    normalization statistics put back after it. For a refusal's diagnosis only (one forward of
    one chunk more)."""
    now, norms = RngStates.capture(), NormStats(model)
    reads = _Reads(params)
    try:
        rng.restore()
        with torch.no_grad(), reads:
            forward()
    finally:
        norms.restore()
        now.restore()
    return list(reads.read.values())
