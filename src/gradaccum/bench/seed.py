"""The seed's MindSpore-style accumulator, redone in PyTorch so that its memory can be measured.

The seed tutorial keeps two parameter-shaped buffers next to the model: ``inner_grads``, where
each micro-batch's gradients are added, and ``zeros``, copied over ``inner_grads`` after every
update to reset it. Its counter starts at 1 and the optimizer steps when ``counter % N == 0``,
on the plain sum (no division by N). gradaccum keeps no buffer: gradients add up in ``.grad``.
"""

from __future__ import annotations

import torch

__all__ = ["SeedAccumulator"]


class SeedAccumulator:
    """Sum micro-batch gradients into a buffer; step on the sum every ``steps`` micro-batches.

    Args:
        params: the parameters to train.
        optimizer: the optimizer over ``params``.
        steps: micro-batches per update (N).

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> acc = SeedAccumulator(list(model.parameters()),
        ...                       torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
        >>> [acc.backward(model(torch.randn(4, 3)).sum()) for _ in range(4)]
        [False, True, False, True]
    """

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 steps: int) -> None:
        self.params = params
        self.optimizer = optimizer
        self.steps = steps
        self.inner_grads = [torch.zeros_like(p) for p in params]
        self.zeros = [torch.zeros_like(p) for p in params]
        self.counter = 1

    def backward(self, loss: torch.Tensor) -> bool:
        """Add one micro-batch's gradients to the sum; step on the sum when the window is full.

        Returns:
            True when the optimizer stepped.
        """
        grads = torch.autograd.grad(loss, self.params)  # what MindSpore's grad function returns
        torch._foreach_add_(self.inner_grads, grads)
        stepped = self.counter % self.steps == 0
        if stepped:
            # MindSpore's optimizer takes the gradients as an argument; in PyTorch they go through
            # .grad, aliased (no copy), and are detached again after the step.
            for p, g in zip(self.params, self.inner_grads, strict=True):
                p.grad = g
            self.optimizer.step()
            for p in self.params:
                p.grad = None
            torch._foreach_copy_(self.inner_grads, self.zeros)
        self.counter += 1
        return stepped
