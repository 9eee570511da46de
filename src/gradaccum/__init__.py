"""gradaccum: train with a large effective batch on a device that holds only a small one.

Split each batch into micro-batches, accumulate their gradients, update once: exactly the same
update as the large batch, to float tolerance.

Example:
    >>> import torch, gradaccum
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> acc = gradaccum.Accumulator(opt, steps=4)
    >>> for xb in torch.randn(16, 4).split(4):
    ...     stepped = acc.backward(model(xb).pow(2).mean())
    >>> acc.optimizer_steps
    1
"""

from gradaccum.core import (
    Schedule,
    check_batch_sizes,
    lr_scale,
    parse_schedule,
    resolve_batch_sizes,
    scaled_momentum,
    split_sizes,
)
from gradaccum.core.memory import MemoryEstimate
from gradaccum.torch import (
    Accumulator,
    AutoBatch,
    CheckReport,
    MicroBatch,
    NoMicroBatchFitsError,
    WindowBatchNorm,
    batch_size,
    check_equivalence,
    count_tokens,
    is_oom_error,
    restore_batchnorm,
    restore_momentum_,
    scale_momentum_,
    split_batch,
    to_groupnorm,
    to_window_batchnorm,
    window_batchnorm,
)

__version__ = "0.2.0"

__all__ = [
    "Accumulator",
    "AutoBatch",
    "CheckReport",
    "MemoryEstimate",
    "MicroBatch",
    "NoMicroBatchFitsError",
    "Schedule",
    "WindowBatchNorm",
    "__version__",
    "batch_size",
    "check_batch_sizes",
    "check_equivalence",
    "count_tokens",
    "is_oom_error",
    "lr_scale",
    "parse_schedule",
    "resolve_batch_sizes",
    "restore_batchnorm",
    "restore_momentum_",
    "scale_momentum_",
    "scaled_momentum",
    "split_batch",
    "split_sizes",
    "to_groupnorm",
    "to_window_batchnorm",
    "window_batchnorm",
]
