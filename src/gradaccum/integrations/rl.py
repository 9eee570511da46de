"""RL policy losses (TRL's loss types) fed to an accumulator exactly (docs/INTEGRATIONS.md).

A policy-gradient loss is a per-token loss times a completion mask, reduced in one of two ways:
per sequence (each sequence's tokens averaged or summed, then the mean over sequences) or per
token (the sum over every completion token of the batch, divided by their number). Accumulated
over micro-batches, each is exact only with its own count: the number of sequences for the
first, the number of completion tokens for the second. :func:`policy_loss` returns the
micro-batch's loss with that count and the reduction to pass, for each loss type of TRL's
``GRPOTrainer`` (TRL 1.16): the window is then the full batch's loss, whatever the split into
micro-batches, ranks or generation batches.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

__all__ = ["LOSS_TYPES", "PolicyLoss", "policy_loss"]

Count = Literal["sequences", "tokens"]
Reduction = Literal["mean", "sum"]

LOSS_TYPES: dict[str, tuple[Count, Reduction]] = {
    "grpo": ("sequences", "mean"),
    "sapo": ("sequences", "mean"),
    "dr_grpo": ("sequences", "mean"),
    "luspo": ("sequences", "mean"),
    "bnpo": ("tokens", "sum"),
    "dapo": ("tokens", "sum"),
    "cispo": ("tokens", "sum"),
    "vespo": ("tokens", "sum"),
}
"""For each loss type of TRL's ``GRPOTrainer``: what ``n_items`` counts and the ``reduction`` of
the loss that goes with it."""


class PolicyLoss(NamedTuple):
    """A micro-batch's policy loss and what to pass with it to ``Accumulator.backward``.

    Attributes:
        loss: the micro-batch's loss, reduced as ``reduction`` says.
        n_items: the count to pass as ``n_items``: sequences or completion tokens.
        reduction: the ``reduction`` to pass: ``"mean"`` or ``"sum"``.
    """

    loss: torch.Tensor
    n_items: int | torch.Tensor
    reduction: Reduction


def policy_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, *,
                max_completion_length: int | None = None) -> PolicyLoss:
    """The micro-batch's loss for ``loss_type``, its ``n_items`` and its ``reduction``.

    Per sequence (``n_items`` = the micro-batch's sequences, ``reduction="mean"``): TRL's own
    per-micro-batch loss, without the division by the accumulation steps. ``grpo``, ``sapo``:
    the mean over sequences of each sequence's token mean; ``dr_grpo``: the token sum divided by
    sequences x ``max_completion_length``; ``luspo``: the mean over sequences of each sequence's
    token sum. Per token (``n_items`` = the completion tokens, a 0-dim tensor: no host sync;
    ``reduction="sum"``): ``bnpo``, ``dapo``, ``cispo``, ``vespo``: the sum over the tokens, which
    the accumulator divides by the window's token total over every micro-batch and rank (TRL
    divides dapo, cispo and vespo by a generation batch's count, bnpo by each micro-batch's).

    Args:
        per_token_loss: ``(B, T)`` (or ``(B, 1)``, broadcast over the tokens, as TRL's
            sequence-level importance sampling gives) per-token losses.
        mask: ``(B, T)`` completion mask, 1 on the tokens that count (TRL's ``completion_mask``,
            times its ``tool_mask`` if any).
        loss_type: one of :data:`LOSS_TYPES`.
        max_completion_length: ``dr_grpo``'s constant length (required for it, ignored otherwise).

    Returns:
        ``PolicyLoss(loss, n_items, reduction)``: call
        ``acc.backward(loss, n_items, reduction=reduction)``.

    Raises:
        ValueError: an unknown ``loss_type``; shapes that do not match; ``dr_grpo`` without a
            positive ``max_completion_length``.

    Example:
        >>> per_token = torch.tensor([[1.0, 3.0], [2.0, 0.0]])  # your per-token loss
        >>> mask = torch.tensor([[1, 1], [1, 0]])
        >>> loss, n_items, reduction = policy_loss(per_token, mask, "grpo")
        >>> float(loss), n_items, reduction  # the mean of the sequence means (2 and 2)
        (2.0, 2, 'mean')
        >>> loss, n_items, reduction = policy_loss(per_token, mask, "dapo")
        >>> float(loss), int(n_items), reduction  # the token sum, over 3 tokens
        (6.0, 3, 'sum')
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    _check_shapes(per_token_loss, mask)
    masked = per_token_loss * mask
    sequences = mask.size(0)
    if loss_type in ("grpo", "sapo"):
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "dr_grpo":
        if not isinstance(max_completion_length, int) or max_completion_length <= 0:
            raise ValueError("dr_grpo needs max_completion_length, a positive int, got "
                             f"{max_completion_length!r}")
        loss = masked.sum() / (sequences * max_completion_length)
    elif loss_type == "luspo":
        loss = masked.sum(-1).mean()
    else:
        return PolicyLoss(masked.sum(), mask.sum(), "sum")
    return PolicyLoss(loss, sequences, "mean")


def _check_shapes(per_token_loss: torch.Tensor, mask: torch.Tensor) -> None:
    if mask.dim() != 2 or mask.size(0) == 0:
        raise ValueError(f"mask must be (sequences, tokens) with at least one sequence, got shape "
                         f"{tuple(mask.shape)}")
    if per_token_loss.dim() != 2 or per_token_loss.size(0) != mask.size(0) \
            or per_token_loss.size(1) not in (1, mask.size(1)):
        raise ValueError(f"per_token_loss must be {tuple(mask.shape)} like the mask, or "
                         f"({mask.size(0)}, 1), got shape {tuple(per_token_loss.shape)}")
