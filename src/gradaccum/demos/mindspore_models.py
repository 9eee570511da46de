"""The demo models on MindSpore: the torch model of the same name, layer by layer, same weights.

Building the torch model first (with its seed and ``init``) and copying its weights makes a
MindSpore run start from exactly the parameters of the torch run with the same settings, so the
two backends can be compared side by side.
"""

from __future__ import annotations

from collections.abc import Callable

import mindspore as ms
from mindspore import nn as msnn
from torch import nn

from gradaccum.demos.models import build_model

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


def _pool(layer: nn.MaxPool2d) -> msnn.Cell:
    return msnn.MaxPool2d(kernel_size=layer.kernel_size, stride=layer.stride)


_CONVERTERS: dict[type[nn.Module], Callable[..., msnn.Cell]] = {
    nn.Linear: _dense,
    nn.Conv2d: _conv,
    nn.MaxPool2d: _pool,
    nn.ReLU: lambda _: msnn.ReLU(),
    nn.Flatten: lambda _: msnn.Flatten(),
}


def to_mindspore(model: nn.Sequential) -> msnn.SequentialCell:
    """A MindSpore copy of a torch ``nn.Sequential`` of Linear, Conv2d, MaxPool2d, ReLU, Flatten.

    Returns:
        A ``SequentialCell`` with the same weights, parameters in the same order.

    Raises:
        ValueError: a layer with no MindSpore counterpart here (BatchNorm, strided convolution).

    Example:
        >>> import torch
        >>> net = to_mindspore(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()))
        >>> [tuple(p.shape) for p in net.trainable_params()]
        [(2, 3), (2,)]
    """
    cells = []
    for layer in model:
        convert = _CONVERTERS.get(type(layer))
        if convert is None:
            raise ValueError(f"no MindSpore counterpart for {type(layer).__name__} in the demo models")
        cells.append(convert(layer))
    return msnn.SequentialCell(cells)


def build_mindspore_model(name: str, init: str = "torch", seed: int | None = None) -> msnn.Cell:
    """The demo model ``name`` on MindSpore (``mlp`` or ``cnn``), with the weights
    :func:`gradaccum.demos.models.build_model` draws for the same ``init`` and ``seed``.

    Raises:
        ValueError: an unknown name or init, or a model with BatchNorm (``cnn-bn``).
    """
    if name == "cnn-bn":
        raise ValueError("model 'cnn-bn' runs on the torch backend only (BatchNorm)")
    model = build_model(name, init, seed)
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"model {name!r} is not a plain Sequential")
    return to_mindspore(model)
