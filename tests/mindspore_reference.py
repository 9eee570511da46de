"""MindSpore test helpers: a small network, data, the full-batch reference, and the tutorial's
accumulator rewritten from its description (the reference the issue compares against).

Import only after ``pytest.importorskip("mindspore.nn")``.
"""

from __future__ import annotations

from collections.abc import Sequence

import mindspore as ms
import numpy as np
import torch
from mindspore import Parameter, Tensor, nn, ops

ms.set_device("CPU")

D_IN, HIDDEN, D_OUT = 6, 8, 3
LOSS = nn.CrossEntropyLoss()


def net(seed: int = 0) -> nn.Cell:
    """A small smooth MLP (tanh), its weights drawn by NumPy so that every copy is identical."""
    model = nn.SequentialCell(nn.Dense(D_IN, HIDDEN), nn.Tanh(), nn.Dense(HIDDEN, D_OUT))
    rng = np.random.default_rng(seed)
    for p in model.trainable_params():
        p.set_data(Tensor(rng.normal(0.0, 0.5, p.shape).astype(np.float32)))
    return model


def data(n: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    rng = np.random.default_rng(seed)
    return (Tensor(rng.standard_normal((n, D_IN)).astype(np.float32)),
            Tensor(rng.integers(0, D_OUT, n).astype(np.int32)))


def grad_fn(model: nn.Cell):
    """``(x, y) -> (mean loss, grads)`` for ``model``'s trainable parameters."""

    def forward(x: Tensor, y: Tensor) -> Tensor:
        return LOSS(model(x), y)

    return ms.value_and_grad(forward, None, model.trainable_params())


def params(model: nn.Cell) -> list[np.ndarray]:
    return [p.asnumpy().copy() for p in model.trainable_params()]


def assert_params_close(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> None:
    """float32: torch.testing.assert_close defaults (rounding only)."""
    for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
        torch.testing.assert_close(torch.from_numpy(pa), torch.from_numpy(pb),
                                   msg=lambda m, i=i: f"parameter {i}: {m}")


def params_differ(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """True when the two sets are NOT close (the negative twins' check)."""
    try:
        assert_params_close(a, b)
    except AssertionError:
        return True
    return False


def clip_(grads: Sequence[Tensor], max_norm: float) -> tuple[Tensor, ...]:
    """Plain global-norm clipping with torch's clip_grad_norm_ coefficient."""
    norm = float(np.sqrt(sum(float((g.asnumpy().astype(np.float64) ** 2).sum()) for g in grads)))
    coef = min(max_norm / (norm + 1e-6), 1.0)
    return tuple(g * coef for g in grads)


def full_batch_steps(model: nn.Cell, opt: nn.Optimizer, windows: Sequence[tuple[Tensor, Tensor]],
                     clip_norm: float | None = None) -> None:
    """One plain step on each window's whole batch: what accumulation must reproduce."""
    fn = grad_fn(model)
    for x, y in windows:
        _, grads = fn(x, y)
        opt(grads if clip_norm is None else clip_(grads, clip_norm))


@ms.jit_class
class TutorialAccumulator:
    """The tutorial's accumulator, as the issue describes it: a sum buffer and a zero copy used
    to reset it (two parameter-sized buffers), a counter that starts at 1 and steps when it is a
    multiple of N, no normalization (the user divides the loss by N), ``clip_norm`` stored but
    never used, and no flush."""

    def __init__(self, optimizer: nn.Optimizer, steps: int, clip_norm: float = 1.0) -> None:
        self.optimizer = optimizer
        self.clip_norm = clip_norm
        self.total = optimizer.parameters.clone(prefix="tutorial_sum", init="zeros")
        self.zero_copy = optimizer.parameters.clone(prefix="tutorial_zeros", init="zeros")
        self.counter = Parameter(Tensor(1, ms.int32), "tutorial_counter")
        self.steps = steps
        self.map = ops.HyperMap()

    def __call__(self, grads: Sequence[Tensor]) -> bool:
        self.map(ops.partial(ops.assign_add), self.total, grads)
        if self.counter % self.steps == 0:
            self.optimizer(self.total)
            self.map(ops.partial(ops.assign), self.total, self.zero_copy)
        ops.assign_add(self.counter, Tensor(1, ms.int32))
        return True


def owned_bytes(obj: object) -> int:
    """Bytes of the Parameters an accumulator holds itself (not its optimizer's)."""
    total = 0
    for name, value in vars(obj).items():
        if name == "optimizer":
            continue
        items = value if isinstance(value, (tuple, list)) else (value,)
        total += sum(p.nbytes for p in items if isinstance(p, Parameter))
    return total
