"""The PyTorch adapter: everything that touches tensors.

``accumulator.py`` and its private helpers (``_*.py``) are the hot path; each feature has a
folder of its own, matching its page in ``docs/``: ``distributed/``, ``check/``, ``memory/``,
``batchnorm/``.

Needs PyTorch (``pip install torch``); ``gradaccum.core`` and ``gradaccum.mindspore`` do not.
"""

try:
    import torch  # noqa: F401
except ImportError as err:
    raise ImportError(
        "gradaccum's PyTorch API needs torch: pip install torch "
        f"(importing torch failed: {err})"
    ) from err

from gradaccum.torch.accumulator import Accumulator, MicroBatch
from gradaccum.torch.batchnorm.convert import restore_batchnorm, to_groupnorm
from gradaccum.torch.batchnorm.momentum import restore_momentum_, scale_momentum_
from gradaccum.torch.batchnorm.window import WindowBatchNorm, to_window_batchnorm, window_batchnorm
from gradaccum.torch.cached.chunks import chunks
from gradaccum.torch.check.checker import check_equivalence
from gradaccum.torch.check.hazards import Hazard
from gradaccum.torch.check.report import CheckReport, TensorDiff
from gradaccum.torch.memory.autobatch import AutoBatch, NoMicroBatchFitsError
from gradaccum.torch.memory.oom import is_oom_error
from gradaccum.torch.memory.split import batch_size, split_batch
from gradaccum.torch.tokens import count_tokens

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
    "chunks",
    "count_tokens",
    "is_oom_error",
    "restore_batchnorm",
    "restore_momentum_",
    "scale_momentum_",
    "split_batch",
    "to_groupnorm",
    "to_window_batchnorm",
    "window_batchnorm",
]
