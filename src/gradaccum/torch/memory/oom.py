"""Out-of-memory errors: recognizing them, freeing what they left, agreeing on them across ranks."""

from __future__ import annotations

import gc

import torch

__all__ = ["cuda_in_use", "is_oom_error", "release_memory"]

# Messages of the allocators that raise a plain RuntimeError instead of torch.OutOfMemoryError:
# the CPU allocator, CUDA errors raised by a kernel launch or a library, and cuBLAS/cuDNN
# workspaces. Matched case-insensitively.
_OOM_MESSAGES = (
    "out of memory",  # "CUDA error: out of memory", "MPS backend out of memory", XPU, HIP
    "defaultcpuallocator: can't allocate memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
)


def is_oom_error(error: BaseException) -> bool:
    """True when ``error`` means a device or host ran out of memory.

    Recognizes ``torch.OutOfMemoryError`` and the ``RuntimeError`` s that the CPU allocator
    ("DefaultCPUAllocator: can't allocate memory") and CUDA ("CUDA error: out of memory", cuBLAS
    and cuDNN allocation failures) raise.

    Example:
        >>> is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_oom_error(RuntimeError("shape mismatch"))
        False
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    message = str(error).lower()
    return any(m in message for m in _OOM_MESSAGES)


def cuda_in_use() -> bool:
    """True when this process has initialized CUDA (asking never initializes it)."""
    return torch.cuda.is_available() and bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def release_memory() -> None:
    """Free what a failed step left: collect dropped tensors, return cached CUDA blocks.

    Call it after the references to the failed step (its exception, loss, outputs) are gone.
    """
    gc.collect()  # a traceback cycle may still hold a frame full of activations
    if cuda_in_use():
        torch.cuda.empty_cache()
