"""The PyTorch adapter: everything that touches tensors."""

from gradaccum.torch.accumulator import Accumulator, MicroBatch
from gradaccum.torch.autobatch import AutoBatch, NoMicroBatchFitsError
from gradaccum.torch.batch_split import batch_size, split_batch
from gradaccum.torch.checker import CheckReport, TensorDiff, check_equivalence
from gradaccum.torch.hazards import Hazard
from gradaccum.torch.oom import is_oom_error

__all__ = [
    "Accumulator",
    "AutoBatch",
    "CheckReport",
    "Hazard",
    "MicroBatch",
    "NoMicroBatchFitsError",
    "TensorDiff",
    "batch_size",
    "check_equivalence",
    "is_oom_error",
    "split_batch",
]
