"""Counting the items (tokens) a micro-batch's loss is averaged over, without a host sync."""

from __future__ import annotations

import torch

__all__ = ["count_tokens"]


def count_tokens(labels: torch.Tensor, *, ignore_index: int = -100, shift: bool = False) -> torch.Tensor:
    """The number of labels a token loss averages over: those not equal to ``ignore_index``.

    Pass it as ``n_items`` so that a window's gradient is the mean over all of its tokens. The
    count stays on the labels' device (a 0-dim ``int64`` tensor): no host sync per micro-step.

    Args:
        labels: integer labels of any shape (``[batch, seq]`` for a language model).
        ignore_index: the label that marks padding or masked positions (PyTorch's and Hugging
            Face's default, -100).
        shift: count ``labels[..., 1:]``: what a causal language model's loss sees, since it
            predicts token ``t + 1`` from position ``t`` and drops each sequence's first label
            (Hugging Face ``*ForCausalLM`` models shift the labels you pass them).

    Returns:
        A 0-dim integer tensor on ``labels``'s device.

    Raises:
        TypeError: ``labels`` is not an integer tensor, or ``ignore_index`` is not an int.
        ValueError: ``shift=True`` on a 0-dim tensor.

    Example:
        >>> labels = torch.tensor([[5, 7, -100], [3, -100, -100]])
        >>> int(count_tokens(labels)), int(count_tokens(labels, shift=True))
        (3, 1)
    """
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got a {type(labels).__name__}: pass the batch's "
                        "labels tensor, e.g. count_tokens(batch['labels']) (torch.tensor(labels) for a "
                        "list)")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}: pass the token ids with "
                        "-100 at padding (the labels a causal LM's loss takes); for a mask, use "
                        "mask.sum() as n_items")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if shift:
        if labels.dim() == 0:
            raise ValueError("count_tokens(shift=True) needs labels with a sequence dimension, "
                             "got a 0-dim tensor")
        labels = labels[..., 1:]
    return (labels != ignore_index).sum()
