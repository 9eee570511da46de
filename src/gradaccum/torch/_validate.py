"""Argument checks of the torch adapter (the framework-free ones live in ``gradaccum.core``)."""

from __future__ import annotations

from typing import Any

import torch

from gradaccum.core.validate import check_positive_int

__all__ = ["check_items", "check_loss", "check_parts"]


def check_loss(loss: Any) -> None:
    """Raise unless ``loss`` is a floating scalar tensor that requires grad.

    Raises:
        TypeError: not a tensor.
        ValueError: not a scalar, or it does not require grad.
    """
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss must be a torch.Tensor, got {loss!r} ({type(loss).__name__})")
    if loss.numel() != 1:
        raise ValueError(
            f"loss must be a scalar (the mean over the micro-batch), got shape {tuple(loss.shape)}"
        )
    if not loss.requires_grad:
        raise ValueError(
            f"loss does not require grad (loss={loss.detach()!r}): was it computed under "
            "torch.no_grad(), or detached?"
        )


def check_items(n_items: Any) -> Any:
    """Validate ``n_items``: None, an int >= 1, or an integer scalar tensor.

    A tensor's value is checked only on the CPU: reading a device tensor would synchronize the
    GPU on every micro-step.

    Returns:
        ``n_items`` (an int, a 0-dim tensor or None).

    Raises:
        TypeError: a float, bool, string, or a non-integer tensor.
        ValueError: 0 or negative, or a tensor with more than one element.
    """
    if n_items is None:
        return None
    if isinstance(n_items, torch.Tensor):
        if n_items.numel() != 1:
            raise ValueError(f"n_items must be a scalar, got a tensor of shape {tuple(n_items.shape)}")
        if n_items.dtype.is_floating_point or n_items.dtype.is_complex or n_items.dtype == torch.bool:
            raise TypeError(f"n_items must be an integer count, got a {n_items.dtype} tensor")
        if n_items.device.type == "cpu" and int(n_items) < 1:
            raise ValueError(f"n_items must be >= 1, got {int(n_items)}")
        return n_items.reshape(())
    return check_positive_int("n_items", n_items)


def check_parts(optimizer: Any, model: Any, scheduler: Any, scaler: Any) -> None:
    """Check the objects an :class:`~gradaccum.Accumulator` is built from.

    Raises:
        TypeError: an object of the wrong kind.
        ValueError: a scheduler bound to another optimizer.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if scheduler is not None:
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler must have a step() method, got {type(scheduler).__name__}")
        bound = getattr(scheduler, "optimizer", optimizer)
        if bound is not optimizer:
            raise ValueError("scheduler is bound to another optimizer than the accumulator's")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
