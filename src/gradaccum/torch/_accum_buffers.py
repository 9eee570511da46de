"""Wide accumulation buffers: sum the micro-batch gradients of bf16/fp16 parameters in float32.

Adding many bf16 gradients into a bf16 ``.grad`` rounds every partial sum to 8 significant bits,
so the window's gradient drifts as ``steps`` grows. With ``accum_dtype=torch.float32`` the
accumulator keeps one float32 buffer per narrow trainable parameter: right after each backward,
:meth:`AccumBuffers.collect` folds the fresh ``.grad`` into its buffer (one foreach pass: a copy for
the parameter's first gradient of the window, an add afterwards) and drops ``.grad``, so the next
backward writes a fresh gradient instead of adding in low precision. At the boundary the
accumulator unscales, normalizes and clips the buffers in float32, and :meth:`AccumBuffers.publish`
casts them into ``.grad`` for the optimizer: one rounding per window instead of one per micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["WIDE_DTYPES", "AccumBuffers"]

WIDE_DTYPES = (torch.float32, torch.float64)


class AccumBuffers:
    """One ``dtype`` buffer per trainable parameter narrower than ``dtype``, allocated on first use.

    Parameters already as wide as ``dtype`` are left alone: their ``.grad`` accumulates as usual.
    A buffer only counts for the window once a gradient reached it, so a parameter that received
    no gradient in a window keeps ``grad=None`` (optimizers skip it, as without buffers).

    Args:
        params: the optimizer's parameters.
        dtype: ``torch.float32`` or ``torch.float64``.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> bufs = AccumBuffers([w], torch.float32)
        >>> for _ in range(3):
        ...     (w * 1.001).sum().backward()
        ...     bufs.collect()
        >>> w.grad is None, bufs.grads()[0]
        (True, tensor([3., 3.]))
    """

    def __init__(self, params: Iterable[torch.Tensor], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.params = [p for p in params
                       if p.requires_grad and p.is_floating_point() and p.dtype.itemsize < dtype.itemsize]
        self.buffers: list[torch.Tensor] | None = None
        self._filled = [False] * len(self.params)

    def __len__(self) -> int:
        return len(self.params)

    @property
    def nbytes(self) -> int:
        """Bytes the buffers take (0 until the first :meth:`collect`)."""
        return 0 if self.buffers is None else sum(b.numel() * b.element_size() for b in self.buffers)

    def _allocate(self) -> list[torch.Tensor]:
        if self.buffers is None:
            self.buffers = [torch.empty_like(p, dtype=self.dtype, memory_format=torch.preserve_format)
                            for p in self.params]
        return self.buffers

    def collect(self) -> None:
        """Fold every fresh ``.grad`` of the narrow parameters into its buffer; set ``.grad`` to None.

        Call it after each backward. One foreach copy (first gradient of the window) and one foreach
        add (later ones) over disjoint tensors: a single pass over the gradients.
        """
        buffers = self._allocate()
        copy_dst: list[torch.Tensor] = []
        copy_src: list[torch.Tensor] = []
        add_dst: list[torch.Tensor] = []
        add_src: list[torch.Tensor] = []
        filled = self._filled
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if filled[i]:
                add_dst.append(buffers[i])
                add_src.append(g)
            else:
                copy_dst.append(buffers[i])
                copy_src.append(g)
                filled[i] = True
            p.grad = None
        with torch.no_grad():
            if copy_dst:
                torch._foreach_copy_(copy_dst, copy_src)
            if add_dst:
                torch._foreach_add_(add_dst, add_src)

    def filled(self) -> list[bool]:
        """For each parameter, whether its buffer holds a gradient this window."""
        return list(self._filled)

    def all_buffers(self) -> list[torch.Tensor]:
        """Every buffer (allocated on first use), filled or not."""
        return self._allocate()

    def fill_zero(self, i: int) -> torch.Tensor:
        """Buffer ``i``, zeroed and counted for this window (another rank has its gradient)."""
        buffer = self._allocate()[i]
        buffer.zero_()
        self._filled[i] = True
        return buffer

    def grads(self) -> list[torch.Tensor]:
        """The buffers that hold a gradient this window (the wide window gradient)."""
        if self.buffers is None:
            return []
        return [b for b, f in zip(self.buffers, self._filled, strict=True) if f]

    def publish(self) -> None:
        """Cast every filled buffer into its parameter's ``.grad`` (one rounding per window)."""
        if self.buffers is None:
            return
        for p, b, f in zip(self.params, self.buffers, self._filled, strict=True):
            if f:
                p.grad = b.to(p.dtype)

    def clear(self) -> None:
        """Start a new window: every buffer counts as empty (no pass: the next gradient is copied)."""
        self._filled = [False] * len(self.params)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The dtype and copies of the filled buffers (None for the others)."""
        saved: list[torch.Tensor | None] = [None] * len(self.params)
        for i, (b, f) in enumerate(zip(self.buffers or [], self._filled, strict=False)):
            if f:
                saved[i] = b.detach().clone()
        return {"dtype": str(self.dtype), "buffers": saved}

    def check_state(self, state: Any) -> None:
        """Raise unless ``state`` (from :meth:`state_dict`) fits these buffers; changes nothing.

        Raises:
            ValueError: saved with another ``accum_dtype``, without one, or for other parameters.
        """
        if not isinstance(state, Mapping) or state.get("dtype") != str(self.dtype):
            saved = state.get("dtype") if isinstance(state, Mapping) else None
            raise ValueError(f"state was saved with accum_dtype={saved}, this accumulator has "
                             f"accum_dtype={self.dtype}")
        saved_buffers = state["buffers"]
        if len(saved_buffers) != len(self.params):
            raise ValueError(f"state holds {len(saved_buffers)} accumulation buffers for "
                             f"{len(self.params)} parameters narrower than {self.dtype}")
        for i, (p, b) in enumerate(zip(self.params, saved_buffers, strict=True)):
            if b is not None and tuple(b.shape) != tuple(p.shape):
                raise ValueError(f"accumulation buffer {i} has shape {tuple(b.shape)}, "
                                 f"its parameter {tuple(p.shape)}")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore buffers saved by :meth:`state_dict` (call :meth:`check_state` first)."""
        saved: Sequence[torch.Tensor | None] = state["buffers"]
        buffers = self._allocate() if any(b is not None for b in saved) else self.buffers
        self._filled = [b is not None for b in saved]
        if buffers is None:
            return
        with torch.no_grad():
            for buf, b in zip(buffers, saved, strict=True):
                if b is not None:
                    buf.copy_(b)
