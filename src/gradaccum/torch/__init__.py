"""The PyTorch adapter: everything that touches tensors."""

from gradaccum.torch.accumulator import Accumulator, MicroBatch
from gradaccum.torch.autobatch import AutoBatch, NoMicroBatchFitsError
from gradaccum.torch.batch_split import batch_size, split_batch
from gradaccum.torch.batchnorm import (
    restore_batchnorm,
    restore_momentum_,
    scale_momentum_,
    to_groupnorm,
)
from gradaccum.torch.checker import CheckReport, TensorDiff, check_equivalence
from gradaccum.torch.hazards import Hazard
from gradaccum.torch.oom import is_oom_error
from gradaccum.torch.window_bn import WindowBatchNorm, to_window_batchnorm, window_batchnorm

__all__ = [
    "Accumulator",
    "AutoBatch",
    "CheckReport",
    "Hazard",
    "MicroBatch",
    "NoMicroBatchFitsError",
    "TensorDiff",
    "WindowBatchNorm",
    "batch_size",
    "check_equivalence",
    "is_oom_error",
    "restore_batchnorm",
    "restore_momentum_",
    "scale_momentum_",
    "split_batch",
    "to_groupnorm",
    "to_window_batchnorm",
    "window_batchnorm",
]
