"""The losses the equivalence checker runs: named ones, or the user's ``loss(output, targets)``.

A loss returns the batch's mean loss, or ``(mean loss, n_items)``: the mean over ``n_items``
items (tokens), which makes both runs item-weighted (the full batch's mean over all its items;
each micro-batch fed as ``acc.backward(loss, n_items)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradaccum.torch.tokens import count_tokens

__all__ = ["LOSSES", "LossFn", "causal_lm_loss", "first_tensor", "item_count", "named_loss",
           "random_targets", "split_loss", "token_cross_entropy"]

LossFn = Callable[[Any, torch.Tensor], Any]
LOSSES = ("mse", "cross-entropy", "token-cross-entropy", "causal-lm")


def token_cross_entropy(output: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A language model's loss and its item count: cross-entropy over the last (vocabulary) axis.

    Args:
        output: logits ``[..., vocab]`` (or a tuple whose first element they are, or an object
            with ``.logits``, as Hugging Face models return).
        targets: token ids ``[...]`` aligned with the logits (already shifted for a causal LM),
            -100 at padding.

    Returns:
        ``(mean over the targets that are not -100, their number)``.

    Example:
        >>> logits = torch.zeros(2, 3, 5)
        >>> loss, n = token_cross_entropy(logits, torch.tensor([[1, 2, -100], [4, -100, -100]]))
        >>> round(float(loss), 4), int(n)
        (1.6094, 3)
    """
    logits = first_tensor(output)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss, count_tokens(targets)


def causal_lm_loss(output: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal LM's own loss over shifted labels, and its count: ``count_tokens(labels, shift=True)``.

    Args:
        output: a Hugging Face model's output with ``.loss`` (the model computed it from the
            ``labels`` it was given, shifting them itself), or logits ``[..., seq, vocab]``:
            position ``t`` predicts label ``t + 1``.
        targets: the unshifted labels ``[..., seq]``, -100 at padding.

    Returns:
        ``(mean over the shifted labels that are not -100, their number)``.

    Example:
        >>> loss, n = causal_lm_loss(torch.zeros(1, 3, 5), torch.tensor([[1, 2, -100]]))
        >>> round(float(loss), 4), int(n)
        (1.6094, 1)
    """
    loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        logits = first_tensor(output)[..., :-1, :]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets[..., 1:].reshape(-1))
    return loss, count_tokens(targets, shift=True)


def named_loss(loss: str | LossFn) -> LossFn:
    """The loss function for ``loss``: one of :data:`LOSSES`, or the callable itself.

    Raises:
        ValueError: an unknown name.
    """
    if callable(loss):
        return loss
    if loss == "mse":
        return lambda out, t: nn.functional.mse_loss(first_tensor(out), t)
    if loss == "cross-entropy":
        return lambda out, t: nn.functional.cross_entropy(first_tensor(out), t)
    if loss == "token-cross-entropy":
        return token_cross_entropy
    if loss == "causal-lm":
        return causal_lm_loss
    raise ValueError(f"loss must be one of {', '.join(map(repr, LOSSES))} or a callable, got {loss!r}")


def first_tensor(out: Any) -> torch.Tensor:
    """The model output's tensor: the output, its first element, or its ``.logits``."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits  # type: ignore[no-any-return]
    raise TypeError(f"the model returned {type(out).__name__}: pass loss=callable(output, targets)")


def split_loss(value: Any, where: str) -> tuple[torch.Tensor, Any]:
    """``(loss, n_items)`` from what a loss returned; ``n_items`` is None for a bare loss.

    Raises:
        TypeError: neither a tensor nor a pair ``(tensor, n_items)`` (the message names ``where``).
    """
    if isinstance(value, torch.Tensor):
        return value, None
    if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], torch.Tensor):
        return value[0], value[1]
    raise TypeError(f"loss on {where} returned {type(value).__name__}: return the mean loss (a "
                    "tensor) or (mean loss, n_items)")


def item_count(n_items: Any, where: str) -> float:
    """``n_items`` as a Python number, for the report (a host read: the checker is not a hot path).

    Raises:
        TypeError: not a number or a one-element tensor.
    """
    try:
        return float(n_items)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"n_items returned by the loss on {where} must be a number or a 0-dim "
                        f"tensor, got {type(n_items).__name__}") from None


def random_targets(out: torch.Tensor, loss: str | LossFn, seed: int) -> torch.Tensor:
    """Targets drawn from their own generator: class indices for the cross-entropy losses, else normal.

    Raises:
        ValueError: ``"cross-entropy"`` on an output without a class dimension 1.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    if loss == "cross-entropy":  # class indices over dimension 1, as cross_entropy reads them
        if out.dim() < 2:
            raise ValueError(f"loss='cross-entropy' needs (batch, classes, ...) outputs, got shape "
                             f"{tuple(out.shape)}")
        return torch.randint(0, out.shape[1], (out.shape[0], *out.shape[2:]), generator=gen)
    if loss in ("token-cross-entropy", "causal-lm"):  # token ids over the last (vocabulary) dimension
        if out.dim() < 2:
            raise ValueError(f"loss={loss!r} needs (batch, ..., vocab) outputs, got "
                             f"shape {tuple(out.shape)}")
        return torch.randint(0, out.shape[-1], tuple(out.shape[:-1]), generator=gen)
    return torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
