"""gradaccum: train with a large effective batch on a device that holds only a small one.

Split each batch into micro-batches, accumulate their gradients, update once: exactly the same
update as the large batch, to float tolerance.

``import gradaccum`` loads the framework-free core only; the PyTorch names (``Accumulator``,
``AutoBatch``, ``check_equivalence``, ...) and the modules ``gradaccum.torch`` and
``gradaccum.contrastive`` (the tiled contrastive losses) and ``gradaccum.moe`` (a mixture of
experts' load-balancing loss) import torch when first used, so that
``gradaccum.mindspore`` and ``gradaccum.core`` work where torch is not installed. Without torch,
using a PyTorch name raises one ImportError that names what to install.

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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

__version__ = "0.3.0"
"""The package's version."""

# The public names that live in gradaccum.torch: loaded on first use (PEP 562), so that the
# MindSpore adapter and the core never need torch. Type checkers see the import below.
_TORCH_NAMES = frozenset({
    "Accumulator", "AutoBatch", "CheckReport", "MicroBatch", "NoMicroBatchFitsError",
    "WindowBatchNorm", "batch_size", "check_equivalence", "chunks", "count_tokens", "is_oom_error",
    "restore_batchnorm", "restore_momentum_", "scale_momentum_", "split_batch", "to_groupnorm",
    "to_window_batchnorm", "window_batchnorm",
})

# The modules that need torch, loaded on first use as attributes (gradaccum.contrastive.clip_loss).
_TORCH_MODULES = frozenset({"torch", "contrastive", "moe"})

if TYPE_CHECKING:
    from gradaccum import contrastive as contrastive  # the tiled losses, as after an eager import
    from gradaccum import moe as moe  # the mixture-of-experts balance, as after an eager import
    from gradaccum import torch as torch  # the adapter module, as after an eager import
    from gradaccum.torch import (
        Accumulator,
        AutoBatch,
        CheckReport,
        MicroBatch,
        NoMicroBatchFitsError,
        WindowBatchNorm,
        batch_size,
        check_equivalence,
        chunks,
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
else:
    # Only at run time: a type checker that saw a module __getattr__ would accept any name.
    def __getattr__(name: str) -> Any:
        """Load a PyTorch name (or the module ``gradaccum.torch`` or ``gradaccum.contrastive``) on
        first use."""
        if name not in _TORCH_MODULES and name not in _TORCH_NAMES:
            raise AttributeError(f"module 'gradaccum' has no attribute {name!r}")
        # gradaccum.torch raises the one-line ImportError naming what to install without torch.
        if name in _TORCH_MODULES:
            value = importlib.import_module(f"gradaccum.{name}")
        else:
            value = getattr(importlib.import_module("gradaccum.torch"), name)
        globals()[name] = value  # later look-ups are plain module attributes
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _TORCH_NAMES)


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
    "chunks",
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
