"""Mixed precision at the window boundary: GradScaler, float32 accumulation, non-finite skip.

:class:`Precision` is what the accumulator asks, per micro-batch, to scale the loss (a
``GradScaler``) and fold the gradient into float32 buffers (``accum_dtype``), and, per window, for
the gradients to normalize (unscaled once) and whether to step. A window with a non-finite
gradient is dropped whole: the optimizer does not step, the scaler backs off, the gradients are
cleared by the accumulator and the next window starts clean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.utils import get_total_norm

from gradaccum.torch._accum_buffers import WIDE_DTYPES, AccumBuffers
from gradaccum.torch._grads import grads_of, grads_used_anywhere, group_by_device, version

__all__ = ["Precision", "active_scaler", "scaler_found_inf", "unscale_wide_"]


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


def unscale_wide_(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor]
) -> None:
    """Unscale gradients the optimizer does not hold (float32 buffers) and record their infs.

    Call it right after ``scaler.unscale_(optimizer)``. The buffers are unscaled in float32 by the
    kernel ``unscale_`` uses, and their found-inf flags are added to the ones ``scaler.step`` and
    ``scaler.update`` read for ``optimizer``: a non-finite buffer skips the step and backs the scale
    off exactly as a non-finite ``.grad`` would. This writes the scaler's per-optimizer record (a
    private structure; the tests pin the behaviour against the installed torch).
    """
    if not grads:
        return
    scale = scaler._get_scale_async()
    assert scale is not None  # unscale_ has run, so the scale exists
    inv_scale = scale.double().reciprocal().float()  # as GradScaler.unscale_ computes it
    by_device = group_by_device(grads)
    record = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    for device, group in by_device.items():
        found = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv_scale.to(device))
        if device in record:
            record[device] += found
        else:
            record[device] = found


def _distributed_wrapper(model: Any, params: Sequence[torch.Tensor]) -> str | None:
    """The name of a data-parallel wrapper that reduces ``.grad`` itself, or None."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)):
        return type(model).__name__
    if any(isinstance(p, DTensor) for p in params):
        return "DTensor parameters (FSDP2)"
    return None


class Precision:
    """The mixed-precision policy of one accumulator (built by it from its keyword options).

    Args:
        optimizer: the accumulator's optimizer.
        params: its parameters, in order.
        scaler: a ``torch.amp.GradScaler`` or None.
        accum_dtype: ``torch.float32`` (or ``float64``) to accumulate narrower parameters'
            gradients in that dtype; None accumulates in ``.grad``.
        skip_nonfinite: without an active scaler, skip a window whose gradient norm is not finite.
        model: the accumulator's model, to refuse ``accum_dtype`` under DDP/FSDP.

    Raises:
        TypeError: ``accum_dtype`` is not a ``torch.dtype``, or ``skip_nonfinite`` not a bool.
        ValueError: ``accum_dtype`` is not float32/float64, or narrower parameters are wrapped in
            DDP or FSDP: those reduce each backward's ``.grad`` themselves, so they would reduce one
            micro-batch's bf16 gradient instead of the float32 sum held outside ``.grad``.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
        >>> p = Precision(torch.optim.SGD([w], lr=1.0), [w], scaler=None,
        ...               accum_dtype=torch.float32, skip_nonfinite=True)
        >>> len(p.buffers)
        1
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.Tensor],
        *,
        scaler: torch.amp.GradScaler | None,
        accum_dtype: torch.dtype | None,
        skip_nonfinite: bool,
        model: Any = None,
    ) -> None:
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"skip_nonfinite must be a bool, got {skip_nonfinite!r}: pass "
                            "skip_nonfinite=True or False")
        self._accum_dtype = None if accum_dtype is None else _check_accum_dtype(accum_dtype)
        self.optimizer = optimizer
        self.scaler = scaler
        self._scaler = active_scaler(scaler)  # read once: the per-micro-step path stays a branch
        self._unscaled = False  # unscale_ ran for this window, update() not yet
        self.skip_nonfinite = skip_nonfinite
        self.stepped_before_error = False  # step() raised after the optimizer had stepped
        self.adopt(params, model)

    def adopt(self, params: Sequence[torch.Tensor], model: Any = None) -> None:
        """Take ``params`` as the accumulator's parameters: at construction, and when its optimizer
        gained a parameter group (before a window's first micro-batch, no wide gradient held).

        Raises:
            ValueError: narrower parameters under FSDP with ``accum_dtype`` (see the class);
                nothing has changed then.
        """
        dtype = self._accum_dtype
        buffers = None if dtype is None else AccumBuffers(params, dtype)
        if buffers:
            wrapper = _distributed_wrapper(model, params)
            if wrapper is not None and wrapper != "DistributedDataParallel":
                raise ValueError(
                    f"accum_dtype={dtype} is not supported under {wrapper}: FSDP already "
                    "accumulates in wide precision; pass fully_shard(..., mp_policy="
                    "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)), "
                    "whose unsharded gradients sum in float32 across no-sync micro-batches and are "
                    "reduce-scattered in float32 (docs/PRECISION.md)")
        self.buffers = buffers if buffers else None
        # Backward passes weighted by a count (n_i, hundreds of tokens) can overflow a GradScaler's
        # fp16 range or float16 gradients: there they are kept at a mean's scale (core.window).
        self.overflow_prone = self._scaler is not None or any(p.dtype == torch.float16 for p in params)
        self._params = list(params)
        wide = set() if self.buffers is None else {id(p) for p in self.buffers.params}
        self._native = [p for p in params if id(p) not in wide]

    def backward(self, loss: torch.Tensor, seed: torch.Tensor | None) -> None:
        """Backward one micro-batch's loss from ``seed`` (its weight in the window), scaled by an
        active scaler, then fold narrow gradients into the wide buffers: the only per-micro-step
        work here."""
        scaler = self._scaler
        seeded_backward(loss if scaler is None else scaler.scale(loss), seed)
        if self.buffers is not None:
            self.buffers.collect()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times an active scaler's scale (as :meth:`backward` scales it), or ``loss``."""
        scaler = self._scaler
        return loss if scaler is None else scaler.scale(loss)

    def collect(self) -> None:
        """Fold the narrow gradients into the wide buffers (:meth:`backward` does it after each
        backward; ``backward_cached`` once, after its last chunk)."""
        if self.buffers is not None:
            self.buffers.collect()

    def average_over_ranks(self, sync: Any) -> None:
        """At the boundary, under DDP with wide buffers: average every gradient of the window (the
        native ``.grad`` and the float32 sums) over the ranks, each in its own dtype, after one
        agreement on which exist anywhere (a rank without one contributes zeros, as DDP does)."""
        assert self.buffers is not None
        native = [p for p in self._native if p.requires_grad]
        wide = self.buffers.all_buffers()
        flags = [p.grad is not None for p in native] + self.buffers.filled()
        anyone = [bool(v) for v in sync.max_over_ranks([int(f) for f in flags])]
        tensors = grads_used_anywhere(native, anyone)
        for i, used in enumerate(anyone[len(native):]):
            if used:
                tensors.append(self.buffers.fill_zero(i) if not flags[len(native) + i] else wide[i])
        sync.average_(tensors)

    def window_grads(self) -> list[torch.Tensor]:
        """At the boundary: the window's gradients, unscaled once, ready to normalize and clip."""
        grads = grads_of(self._native)
        wide = [] if self.buffers is None else self.buffers.grads()
        scaler = self._scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
            self._unscaled = True
            unscale_wide_(scaler, self.optimizer, wide)
        return grads + wide

    def step(self, grads: Sequence[torch.Tensor], norm: torch.Tensor | None) -> tuple[bool, Any]:
        """Step the optimizer unless the window's gradient is non-finite.

        Args:
            grads: the normalized, clipped window gradients (from :meth:`window_grads`).
            norm: their global L2 norm if clipping computed it, else None.

        Returns:
            ``(stepped, norm)``: ``norm`` is computed here (one foreach pass) when the non-finite
            check needs it and clipping did not.
        """
        self.stepped_before_error = False
        scaler = self._scaler
        if scaler is not None:
            found_inf = scaler_found_inf(scaler, self.optimizer)
            if not found_inf:
                self._publish()
            self._watched(scaler.step, self.optimizer)
            self.stepped_before_error = not found_inf  # update() may raise now
            scaler.update()
            self._unscaled = False
            self.stepped_before_error = False
            return not found_inf, norm
        if self.skip_nonfinite and grads:
            if norm is None:
                norm = get_total_norm(grads, foreach=True)
            if not bool(torch.isfinite(norm)):
                return False, norm
        self._publish()
        self._watched(self.optimizer.step)
        return True, norm

    def _watched(self, step: Any, *args: Any) -> None:
        """Run ``step``; if it raises, record whether the parameters changed first (an optimizer
        post-hook raising after the update): the accumulator then still counts the step."""
        probe = next((p for p in self._params if p.grad is not None), None)
        before = None if probe is None else version(probe)
        try:
            step(*args)
        except BaseException:
            self.stepped_before_error = probe is not None and version(probe) != before
            raise

    def _publish(self) -> None:
        if self.buffers is not None:
            self.buffers.publish()

    def abort(self) -> None:
        """After an exception at the boundary: close the scaler's window if ``unscale_`` ran but
        ``update`` did not, so the next window can unscale again (the scale backs off on an inf,
        as after any step). The window's ``stepped_before_error`` has been read: it is reset, so
        a later boundary that fails before its step is not counted as one."""
        self.stepped_before_error = False
        if self._unscaled and self._scaler is not None:
            self._unscaled = False
            self._scaler.update()

    def clear(self) -> None:
        """Forget the window's wide gradients (after a boundary or a discard)."""
        if self.buffers is not None:
            self.buffers.clear()

    def state_dict(self) -> dict[str, Any] | None:
        """The wide buffers' state, or None without ``accum_dtype``."""
        return None if self.buffers is None else self.buffers.state_dict()

    def check_state(self, state: Any) -> None:
        """Raise ValueError unless ``state`` (from :meth:`state_dict`) fits; changes nothing."""
        if self.buffers is not None:
            self.buffers.check_state(state)
        elif state is not None:
            raise ValueError(f"state was saved with accum_dtype={state.get('dtype')}, this "
                             f"accumulator has none: build it with accum_dtype={state.get('dtype')} to "
                             "resume it")

    def load_state_dict(self, state: Any) -> None:
        """Restore the wide buffers (after :meth:`check_state`)."""
        if self.buffers is not None:
            self.buffers.load_state_dict(state)


_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)


def seeded_backward(loss: torch.Tensor, seed: torch.Tensor | None) -> None:
    """``loss.backward(seed)``, straight into autograd's engine for a plain real tensor.

    ``torch.autograd.backward`` first checks, in Python, that each seed has its output's shape
    and kind (a few microseconds per micro-step, a third of a trivial model's overhead): the
    accumulator makes every seed itself with the loss's shape (``_weights.loss_seed``), so those
    checks cannot fail here and the engine (which casts a seed's dtype itself) is called
    directly, as ``torch.autograd.backward`` does after them. A tensor subclass, a complex loss,
    no seed, or a torch without that entry take the public path.
    """
    if (seed is None or _run_backward is None or type(loss) is not torch.Tensor
            or type(seed) is not torch.Tensor or loss.dtype.is_complex):
        loss.backward(seed)  # type: ignore[no-untyped-call]
        return
    _run_backward((loss,), (seed,), False, False, (), allow_unreachable=True, accumulate_grad=True)


def _check_accum_dtype(accum_dtype: Any) -> torch.dtype:
    if not isinstance(accum_dtype, torch.dtype):
        raise TypeError(f"accum_dtype must be a torch.dtype or None, got {accum_dtype!r}: pass "
                        "accum_dtype=torch.float32, or leave it out")
    if accum_dtype not in WIDE_DTYPES:
        raise ValueError(f"accum_dtype must be torch.float32 or torch.float64, got {accum_dtype}: pass "
                         "accum_dtype=torch.float32 (the wide sum of bf16 or fp16 gradients)")
    return accum_dtype
