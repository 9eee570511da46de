"""The demo models: the seed's MLP, two MNIST CNNs (one with BatchNorm) and the benchmark CNN."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gradaccum.demos.config import BN_MODES
from gradaccum.torch import Accumulator, scale_momentum_, to_groupnorm, to_window_batchnorm, window_batchnorm

__all__ = ["BN_MODES", "MODELS", "apply_bn_mode", "bench_cnn", "build_model", "cnn", "cnn_bn",
           "mindspore_init_", "mlp"]


def mlp() -> nn.Module:
    """The seed's network: 784-512-512-10 with ReLU (MNIST, 1x28x28 inputs)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(28 * 28, 512), nn.ReLU(),
        nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 10),
    )


def _mnist_cnn(batchnorm: bool) -> nn.Module:
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        norm: list[nn.Module] = [nn.BatchNorm2d(c_out)] if batchnorm else []
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=not batchnorm), *norm, nn.ReLU(),
                nn.MaxPool2d(2)]

    return nn.Sequential(*block(1, 16), *block(16, 32), nn.Flatten(),
                         nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def cnn() -> nn.Module:
    """A small MNIST CNN: two 3x3 conv blocks (16, 32 channels) and a 128-unit head (~206 k params)."""
    return _mnist_cnn(batchnorm=False)


def cnn_bn() -> nn.Module:
    """:func:`cnn` with a BatchNorm2d after each convolution: the BatchNorm experiment's model."""
    return _mnist_cnn(batchnorm=True)


def bench_cnn(num_classes: int = 10) -> nn.Module:
    """The benchmark CNN: 3x64x64 inputs, four conv blocks and a linear head, ~2.5 M parameters."""
    layers: list[nn.Module] = []
    for c_in, c_out in ((3, 32), (32, 64), (64, 128), (128, 256)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU()]
        if c_in != 3:
            layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(256 * 8 * 8, 128), nn.ReLU(),
                         nn.Linear(128, num_classes))


# name -> (factory, input shape of one sample)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (mlp, (1, 28, 28)),
    "cnn": (cnn, (1, 28, 28)),
    "cnn-bn": (cnn_bn, (1, 28, 28)),
    "bench-cnn": (bench_cnn, (3, 64, 64)),
}


def mindspore_init_(model: nn.Module) -> nn.Module:
    """MindSpore's classic ``nn.Dense`` defaults: N(0, 0.01) weights, zero bias, for every linear
    layer (under which the seed tutorial's table reproduces)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, 0.01)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return model


def build_model(name: str, init: str = "torch", seed: int | None = None) -> nn.Module:
    """Build a demo model by name.

    Args:
        name: one of :data:`MODELS` (``mlp``, ``cnn``, ``cnn-bn``, ``bench-cnn``).
        init: ``"torch"`` (PyTorch's defaults) or ``"mindspore"`` (see :func:`mindspore_init_`).
        seed: seeds ``torch.manual_seed`` first, for identical weights across runs.

    Returns:
        The model.

    Raises:
        ValueError: an unknown name or init.

    Example:
        >>> sum(p.numel() for p in build_model("mlp").parameters())
        669706
    """
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    if init not in ("torch", "mindspore"):
        raise ValueError(f"init must be 'torch' or 'mindspore', got {init!r}")
    if seed is not None:
        torch.manual_seed(seed)
    model = MODELS[name][0]()
    return mindspore_init_(model) if init == "mindspore" else model


def apply_bn_mode(model: nn.Module, mode: str, accumulator: Accumulator | None = None, *,
                  steps: int | None = None) -> nn.Module:
    """Treat the BatchNorm layers of ``model`` for accumulation, by name (see :data:`BN_MODES`).

    ``plain``: unchanged; ``compound`` / ``linear``: :func:`gradaccum.scale_momentum_` for
    ``steps``, or else for the accumulator's N, followed as a schedule changes it; ``window``:
    :func:`gradaccum.window_batchnorm`, committed by the accumulator (without one,
    :func:`gradaccum.to_window_batchnorm`, committed by the caller); ``groupnorm``:
    :func:`gradaccum.to_groupnorm`. Parameters are shared, so an optimizer built before keeps
    working. A model without BatchNorm is returned unchanged.

    Returns:
        The model (use the returned object).

    Raises:
        ValueError: an unknown mode, or a momentum mode with neither steps nor an accumulator.

    Example:
        >>> type(apply_bn_mode(build_model("cnn-bn"), "groupnorm", None)[1]).__name__
        'BatchNormGroupNorm'
    """
    if mode not in BN_MODES:
        raise ValueError(f"bn mode must be one of {list(BN_MODES)}, got {mode!r}")
    if mode in ("compound", "linear"):
        if steps is None and accumulator is None:
            raise ValueError(f"bn mode {mode!r} needs steps or an accumulator, got neither")
        if steps is not None:
            scale_momentum_(model, steps, mode)
        else:
            assert accumulator is not None
            _follow_steps(model, mode, accumulator)
    elif mode == "window":
        model = to_window_batchnorm(model) if accumulator is None else window_batchnorm(model, accumulator)
    elif mode == "groupnorm":
        model = to_groupnorm(model)
    return model


def _follow_steps(model: nn.Module, mode: str, accumulator: Accumulator) -> None:
    """Scale the momentum for the accumulator's N now and again whenever a schedule changes it."""
    current = [accumulator.steps]
    scale_momentum_(model, current[0], mode)

    def rescale(module: nn.Module, args: object) -> None:
        # A forward pre-hook, since the new N is known only once the next window opens, after the
        # boundary hooks; the check is one comparison per forward.
        if accumulator.steps != current[0]:
            current[0] = accumulator.steps
            scale_momentum_(model, current[0], mode)

    model.register_forward_pre_hook(rescale)
