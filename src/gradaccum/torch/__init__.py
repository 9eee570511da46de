"""The PyTorch adapter: everything that touches tensors."""

from gradaccum.torch.accumulator import Accumulator, MicroBatch
from gradaccum.torch.batchnorm import (
    restore_batchnorm,
    restore_momentum_,
    scale_momentum_,
    to_groupnorm,
)
from gradaccum.torch.window_bn import WindowBatchNorm, to_window_batchnorm, window_batchnorm

__all__ = [
    "Accumulator",
    "MicroBatch",
    "WindowBatchNorm",
    "restore_batchnorm",
    "restore_momentum_",
    "scale_momentum_",
    "to_groupnorm",
    "to_window_batchnorm",
    "window_batchnorm",
]
