"""The PyTorch adapter: everything that touches tensors."""

from gradaccum.torch.accumulator import Accumulator, MicroBatch
from gradaccum.torch.autobatch import AutoBatch, NoMicroBatchFitsError
from gradaccum.torch.batch_split import batch_size, split_batch
from gradaccum.torch.oom import is_oom_error

__all__ = [
    "Accumulator",
    "AutoBatch",
    "MicroBatch",
    "NoMicroBatchFitsError",
    "batch_size",
    "is_oom_error",
    "split_batch",
]
