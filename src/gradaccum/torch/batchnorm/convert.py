"""BatchNorm under accumulation: momentum scaling, GroupNorm conversion, and the way back.

With N micro-batches per optimizer step a BatchNorm layer sees micro-batch statistics: it
normalizes each micro-batch by its own mean and variance, and updates its running statistics N
times per step from those. Three tools, each reversible:

* :func:`scale_momentum_` makes the N updates decay the running statistics like one full step
  (the compound rule of :func:`gradaccum.core.momentum.scaled_momentum`, or the linear one).
* :func:`to_groupnorm` replaces every BatchNorm by a GroupNorm, which has no batch dependence at
  all (the affine weights are kept, the same ``Parameter`` objects, so an optimizer built before
  the conversion keeps working).
* :func:`gradaccum.torch.batchnorm.window.to_window_batchnorm` keeps BatchNorm
  but updates the running statistics once per window, exactly as the full batch would.

:func:`restore_batchnorm` turns every converted layer back into the BatchNorm it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import UninitializedParameter

from gradaccum.core.validate import check_positive_int

__all__ = [
    "BatchNormGroupNorm",
    "ConvertedNorm",
    "default_groups",
    "restore_batchnorm",
    "to_groupnorm",
]

class ConvertedNorm(nn.Module):
    """A layer converted from a BatchNorm by gradaccum; :meth:`revert` gives the BatchNorm back."""

    def revert(self) -> nn.Module:
        """The original BatchNorm, holding this layer's current parameters and buffers."""
        raise NotImplementedError

    def _source(self) -> _BatchNorm:
        # Kept out of _modules, so it is neither a submodule nor part of the state_dict.
        source: _BatchNorm = self.__dict__["_gradaccum_source"]
        return source

    def _remember(self, bn: _BatchNorm) -> None:
        self.__dict__["_gradaccum_source"] = bn


def is_batchnorm(module: nn.Module) -> bool:
    """True for a PyTorch BatchNorm (1d/2d/3d, Sync, Lazy) that gradaccum has not converted."""
    return isinstance(module, _BatchNorm) and not isinstance(module, ConvertedNorm)


def check_initialized(name: str, bn: _BatchNorm) -> None:
    """Raise for a lazy BatchNorm that has not seen an input yet (its size is unknown)."""
    if isinstance(bn.weight, UninitializedParameter) or bn.num_features == 0:
        raise ValueError(f"BatchNorm {name or '<model>'} is lazy and uninitialized: "
                         "run one forward before converting it")


def swap_modules(model: nn.Module, convert: Callable[[str, nn.Module], nn.Module | None]) -> nn.Module:
    """Replace every module for which ``convert(name, module)`` returns a new one.

    A module shared at several places is converted once and stays shared. The root itself may be
    replaced, so callers use the returned module.
    """
    memo: dict[int, nn.Module | None] = {}

    def visit(name: str, module: nn.Module) -> nn.Module | None:
        if id(module) not in memo:
            memo[id(module)] = convert(name, module)
            if memo[id(module)] is None:
                # _modules, not named_children(), which yields a shared child only once.
                for child_name, child in list(module._modules.items()):
                    if child is None:
                        continue
                    new = visit(f"{name}.{child_name}" if name else child_name, child)
                    if new is not None:
                        module.add_module(child_name, new)
        return memo[id(module)]

    return visit("", model) or model


def adopt_state(target: nn.Module, source: nn.Module) -> nn.Module:
    """Point ``target``'s parameters and buffers at ``source``'s (the same tensors), copy its mode."""
    for name, param in source._parameters.items():
        target._parameters[name] = param
    for name, buf in source._buffers.items():
        target._buffers[name] = buf
    target.train(source.training)
    return target


# --------------------------------------------------------------------------------- GroupNorm
def default_groups(channels: int, most: int = 32) -> int:
    """The largest divisor of ``channels`` not above ``most`` (GroupNorm's paper uses 32 groups).

    Example:
        >>> default_groups(64), default_groups(16), default_groups(48)
        (32, 16, 24)
    """
    return max(g for g in range(1, min(channels, most) + 1) if channels % g == 0)


class BatchNormGroupNorm(ConvertedNorm, nn.GroupNorm):
    """A GroupNorm made from a BatchNorm by :func:`to_groupnorm`; it remembers the BatchNorm.

    It shares the BatchNorm's affine ``weight`` and ``bias`` (the same ``Parameter`` objects:
    per-channel scale and shift mean the same in both layers); the BatchNorm's running statistics
    wait, untouched, for :meth:`revert`.
    """

    def __init__(self, bn: _BatchNorm, groups: int) -> None:
        factory: dict[str, Any] = {}
        if bn.affine:
            factory = {"device": bn.weight.device, "dtype": bn.weight.dtype}
        nn.GroupNorm.__init__(self, groups, bn.num_features, bn.eps, bn.affine, **factory)
        if bn.affine:
            self.weight, self.bias = bn.weight, bn.bias
        self.train(bn.training)
        self._remember(bn)

    def revert(self) -> nn.Module:
        """The BatchNorm, with this layer's (possibly trained) weight and bias."""
        bn = adopt_state(self._source(), self)
        if self.affine:
            # The model may have moved since the conversion; the BatchNorm's buffers follow it.
            device, dtype = self.weight.device, self.weight.dtype
            for name, buf in bn._buffers.items():
                if buf is not None:
                    bn._buffers[name] = buf.to(device, dtype if buf.is_floating_point() else buf.dtype)
        return bn


def to_groupnorm(model: nn.Module, groups: int | None = None) -> nn.Module:
    """Replace every BatchNorm of ``model`` by a GroupNorm; :func:`restore_batchnorm` reverts it.

    GroupNorm normalizes each sample over groups of channels, so it gives the same output
    whatever the micro-batch size: accumulation is then exact for the whole model. It is a
    different layer, though: a model trained with BatchNorm needs training again.

    Args:
        model: the model (children are replaced in place; a BatchNorm root is returned anew).
        groups: groups per layer; it must divide every BatchNorm's channel count. ``None``: for
            each layer the largest divisor of its channel count not above 32
            (:func:`default_groups`).

    Returns:
        The model (use the returned object: the root itself may have been a BatchNorm).

    Raises:
        TypeError, ValueError: ``groups`` is not a positive integer or does not divide a layer's
            channel count, or a lazy BatchNorm is uninitialized; raised before anything changes.

    Example:
        >>> model = to_groupnorm(nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8)), groups=4)
        >>> type(model[1]).__name__, model[1].num_groups
        ('BatchNormGroupNorm', 4)
        >>> type(restore_batchnorm(model)[1]).__name__
        'BatchNorm2d'
    """
    g = None if groups is None else check_positive_int("groups", groups)
    for name, module in model.named_modules():
        if is_batchnorm(module):
            assert isinstance(module, _BatchNorm)
            check_initialized(name, module)
            if g is not None and module.num_features % g:
                raise ValueError(f"groups must divide the channel count of every BatchNorm, got "
                                 f"groups={g} for {name or '<model>'} ({module.num_features} channels)")

    def convert(name: str, module: nn.Module) -> nn.Module | None:
        if not is_batchnorm(module):
            return None
        assert isinstance(module, _BatchNorm)
        return BatchNormGroupNorm(module, g or default_groups(module.num_features))

    return swap_modules(model, convert)


def restore_batchnorm(model: nn.Module) -> nn.Module:
    """Turn every layer converted by gradaccum (GroupNorm or window BatchNorm) back into its
    original BatchNorm, with the current parameters and buffers.

    Returns:
        The model (use the returned object: the root itself may have been converted).
    """
    return swap_modules(model, lambda _, m: m.revert() if isinstance(m, ConvertedNorm) else None)
