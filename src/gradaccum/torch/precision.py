"""Mixed-precision helpers: the GradScaler at the window boundary."""

from __future__ import annotations

import torch

__all__ = ["active_scaler", "scaler_found_inf"]


def active_scaler(scaler: torch.amp.GradScaler | None) -> torch.amp.GradScaler | None:
    """Return ``scaler`` if it is enabled, else ``None`` (a disabled scaler is a no-op)."""
    return scaler if scaler is not None and scaler.is_enabled() else None


def scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """True when ``scaler.unscale_(optimizer)`` found an inf or NaN in the window's gradients.

    Call it after ``unscale_`` and before ``update``: ``scaler.step`` will then skip the step.
    It reads one flag per device back to the host, once per window.
    """
    found = scaler._found_inf_per_device(optimizer)
    return any(bool(v.item()) for v in found.values())
