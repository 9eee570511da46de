"""The demo models on MindSpore: the torch model of the same name, layer by layer, same weights.

Building the torch model first (with its seed and ``init``) and copying its weights makes a
MindSpore run start from exactly the parameters of the torch run with the same settings, so the
two backends can be compared side by side. The BatchNorm modes that are a property of the model
(``plain``, ``compound`` and ``linear`` momentum, ``groupnorm``) are applied to the torch model
by the torch backend's own conversions, then copied; ``window`` needs the accumulator to commit
the window's statistics and stays on the torch backend.
"""

from __future__ import annotations

from collections.abc import Callable

import mindspore as ms
from mindspore import nn as msnn
from torch import nn

from gradaccum.demos.config import BN_MODES
from gradaccum.demos.models import apply_bn_mode, build_model

__all__ = ["build_mindspore_model", "to_mindspore"]


def _dense(layer: nn.Linear) -> msnn.Cell:
    cell = msnn.Dense(layer.in_features, layer.out_features, has_bias=layer.bias is not None)
    cell.weight.set_data(ms.Tensor(layer.weight.detach().numpy().copy()))
    if layer.bias is not None:
        cell.bias.set_data(ms.Tensor(layer.bias.detach().numpy().copy()))
    return cell


def _conv(layer: nn.Conv2d) -> msnn.Cell:
    if layer.stride != (1, 1) or layer.dilation != (1, 1) or layer.groups != 1:
        raise ValueError(f"to_mindspore converts stride-1 plain convolutions only, got {layer}")
    pad = layer.padding if isinstance(layer.padding, tuple) else (0, 0)
    cell = msnn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, pad_mode="pad",
                       padding=(pad[0], pad[0], pad[1], pad[1]), has_bias=layer.bias is not None)
    cell.weight.set_data(ms.Tensor(layer.weight.detach().numpy().copy()))
    if layer.bias is not None:
        cell.bias.set_data(ms.Tensor(layer.bias.detach().numpy().copy()))
    return cell


def _set(param: ms.Parameter, value: object) -> None:
    param.set_data(ms.Tensor(value.detach().numpy().copy()))  # type: ignore[attr-defined]


def _batchnorm(layer: nn.BatchNorm2d) -> msnn.Cell:
    if layer.momentum is None or not layer.affine or not layer.track_running_stats:
        raise ValueError(f"to_mindspore converts BatchNorm2d with momentum, affine and running "
                         f"statistics only, got {layer}")
    # MindSpore's momentum is the weight of the old statistics: 1 - torch's.
    cell = msnn.BatchNorm2d(layer.num_features, eps=layer.eps, momentum=1.0 - layer.momentum)
    _set(cell.gamma, layer.weight)
    _set(cell.beta, layer.bias)
    _set(cell.moving_mean, layer.running_mean)
    _set(cell.moving_variance, layer.running_var)
    return cell


def _groupnorm(layer: nn.GroupNorm) -> msnn.Cell:
    cell = msnn.GroupNorm(layer.num_groups, layer.num_channels, eps=layer.eps, affine=layer.affine)
    if layer.affine:
        _set(cell.gamma, layer.weight)
        _set(cell.beta, layer.bias)
    return cell


def _pool(layer: nn.MaxPool2d) -> msnn.Cell:
    return msnn.MaxPool2d(kernel_size=layer.kernel_size, stride=layer.stride)


_CONVERTERS: dict[type[nn.Module], Callable[..., msnn.Cell]] = {
    nn.Linear: _dense,
    nn.Conv2d: _conv,
    nn.MaxPool2d: _pool,
    nn.BatchNorm2d: _batchnorm,
    nn.GroupNorm: _groupnorm,
    nn.ReLU: lambda _: msnn.ReLU(),
    nn.Flatten: lambda _: msnn.Flatten(),
}


def to_mindspore(model: nn.Sequential) -> msnn.SequentialCell:
    """A MindSpore copy of a torch ``nn.Sequential`` of Linear, Conv2d, BatchNorm2d, GroupNorm,
    MaxPool2d, ReLU and Flatten.

    Returns:
        A ``SequentialCell`` with the same weights, running statistics and momentum (in
        MindSpore's convention), parameters in the same order.

    Raises:
        ValueError: a layer with no MindSpore counterpart here (a strided convolution, a
            BatchNorm without running statistics, gradaccum's window BatchNorm).

    Example:
        >>> import torch
        >>> net = to_mindspore(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()))
        >>> [tuple(p.shape) for p in net.trainable_params()]
        [(2, 3), (2,)]
    """
    cells = []
    for layer in model:
        # A subclass converts as its base (the GroupNorm that to_groupnorm makes of a BatchNorm).
        convert = next((f for kind, f in _CONVERTERS.items() if isinstance(layer, kind)), None)
        if convert is None:
            raise ValueError(f"no MindSpore counterpart for {type(layer).__name__} in the demo models")
        cells.append(convert(layer))
    return msnn.SequentialCell(cells)


def build_mindspore_model(name: str, init: str = "torch", seed: int | None = None, *,
                          bn: str = "plain", steps: int | None = None) -> msnn.Cell:
    """The demo model ``name`` on MindSpore (``mlp``, ``cnn`` or ``cnn-bn``), with the weights
    :func:`gradaccum.demos.models.build_model` draws for the same ``init`` and ``seed``.

    Args:
        name: the model.
        init: ``"torch"`` or ``"mindspore"``.
        seed: the torch seed the weights are drawn with.
        bn: the BatchNorm mode: ``plain``, ``compound`` or ``linear`` (momentum scaled for
            ``steps``), ``groupnorm``; ``window`` runs on the torch backend only.
        steps: micro-batches per window, for the momentum modes (a constant N).

    Raises:
        ValueError: an unknown name, init or mode, ``window``, or a momentum mode without
            ``steps``.

    Example:
        >>> [p.name for p in build_mindspore_model("cnn-bn", bn="groupnorm").trainable_params()][:3]
        ['0.weight', '1.gamma', '1.beta']
    """
    if bn not in BN_MODES:
        raise ValueError(f"bn mode must be one of {list(BN_MODES)}, got {bn!r}")
    if bn == "window":
        raise ValueError("--bn window runs on the torch backend only: its statistics over the whole "
                         "window are committed by the torch Accumulator at each boundary")
    if bn in ("compound", "linear") and not isinstance(steps, int):
        raise ValueError(f"--bn {bn} on the mindspore backend scales the momentum for a constant "
                         f"--steps, got steps={steps!r}")
    model = build_model(name, init, seed)
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"model {name!r} is not a plain Sequential")
    model = apply_bn_mode(model, bn, None, steps=steps)
    return to_mindspore(model)  # type: ignore[arg-type]
