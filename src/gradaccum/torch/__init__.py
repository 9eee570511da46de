"""The PyTorch adapter: everything that touches tensors.

May import: gradaccum.core

``accumulator.py`` holds the :class:`Accumulator`: the window's state and every public method (the
hot path). Its parts sit beside it as private modules, each told only what it needs: the boundary
(``_boundary.py``), the backward weights (``_weights.py``, ``_terms.py``), mixed precision
(``_precision.py``, ``_accum_buffers.py``), the gradient passes and the window loss (``_grads.py``,
``_window_loss.py``), the guards (``_guards.py``, ``_window_grads.py``, ``_holders.py``,
``_saves.py``, ``_rates.py``; ``_param_groups.py``: the groups an optimizer gains), the
checkpoint record (``_state.py``), a multi-task block (``_micro_batch.py``), window hooks
(``_hooks.py``) and input checks (``_validate.py``). Each feature has a folder of its own,
matching its page in ``docs/``: ``distributed/`` (DISTRIBUTED), ``pipeline/``
(``backward_pipeline``: PIPELINE), ``cached/`` (``backward_cached``: CONTRASTIVE), ``check/``
(CHECK), ``memory/`` (MEMORY), ``batchnorm/`` (BATCHNORM); ``tokens.py`` is ``count_tokens``.

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
