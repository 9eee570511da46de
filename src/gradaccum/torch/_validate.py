"""Argument checks of the torch adapter (the framework-free ones live in ``gradaccum.core``)."""

from __future__ import annotations

import inspect
import math
from numbers import Integral, Real
from typing import Any, Literal, Protocol

import torch

__all__ = ["MAX_EXACT_ITEMS", "Items", "Reduction", "Scheduler", "check_items", "check_loss", "check_parts",
           "check_total", "short_repr"]

Reduction = Literal["mean", "sum"]
Items = int | float | torch.Tensor | None  # a count or weight of one micro-batch


class Scheduler(Protocol):
    """An LR scheduler stepped once per optimizer step: its ``step()`` takes no argument."""

    def step(self) -> Any: ...


# What a message about a bad n_items says to pass.
_COUNT_FIX = ("pass the items the loss averages over, e.g. n_items=len(y) or "
              "gradaccum.count_tokens(labels), or leave n_items=None for a plain mean")

# Item totals are summed and divided in float64: beyond 2**53 an integer count is no longer exact
# there. The same limit holds for a count, a weight and a window's total, as a number or a tensor.
MAX_EXACT_ITEMS = 2**53


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a model output's repr can run to thousands)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_loss(loss: Any) -> None:
    """Raise unless ``loss`` is a floating scalar tensor that requires grad.

    The messages stay short (a model output's repr can run to thousands of characters) and say
    what to pass instead.

    Raises:
        TypeError: not a tensor: a tuple or list (nanoGPT's ``(logits, loss)``), an object with a
            ``.loss`` (a Hugging Face ``ModelOutput``), or anything else.
        ValueError: not a scalar, or it does not require grad.
    """
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(f"loss must be a scalar (the micro-batch's loss), got shape "
                             f"{tuple(loss.shape)}: reduce it first, loss.mean() (or loss.sum() with "
                             "n_items and reduction='sum')")
        if not loss.requires_grad:
            raise ValueError("loss does not require grad (computed under torch.no_grad() or "
                             "torch.inference_mode(), or detached): compute it from the model's output "
                             "with grad enabled, and pass the tensor itself, not loss.detach()")
        return
    kind = type(loss).__name__
    if isinstance(getattr(loss, "loss", None), torch.Tensor) or (
            isinstance(loss, dict) and "loss" in loss):
        raise TypeError(f"loss must be a scalar tensor, got a {kind} (a model output): pass its "
                        "loss, acc.backward(outputs.loss)")
    if isinstance(loss, (tuple, list)):
        if loss and all(isinstance(t, torch.Tensor) and t.numel() == 1 for t in loss):
            raise TypeError(f"loss must be a scalar tensor, got a {kind} of {len(loss)} losses: sum them, "
                            "acc.backward(loss_a + loss_b), or feed each from its own forward in one "
                            "micro-batch: with acc.micro_batch() as mb: mb.backward(loss_a); "
                            "mb.backward(loss_b)")
        raise TypeError(f"loss must be a scalar tensor, got a {kind} of {len(loss)}: pass the loss "
                        "element, e.g. logits, loss = model(x, y); acc.backward(loss)")
    if isinstance(loss, Real):
        raise TypeError(f"loss must be a torch.Tensor (a scalar), got a {kind}: {short_repr(loss)}: pass the "
                        "loss tensor itself, not loss.item() (a Python number has no graph to "
                        "backward through)")
    raise TypeError(f"loss must be a torch.Tensor (a scalar), got a {kind}: {short_repr(loss)}: pass the "
                    "micro-batch's loss tensor, e.g. acc.backward(criterion(model(x), y))")


def check_items(n_items: Any, reduction: Any = "mean") -> Any:
    """Validate ``n_items`` for a loss with ``reduction``.

    A device tensor's value is not checked: reading it would synchronize the device on every
    micro-step.

    Returns:
        ``None``, an ``int``, a ``float``, or a 0-dim tensor of its own dtype (a count or a
        weight; the caller's tensor itself when it already is one: it is read, not changed).

    Raises:
        TypeError: a string, bool, complex or other non-number; ``reduction`` not a string.
        ValueError: negative, NaN, inf, above 2**53 (float64's exact integer range), a tensor
            with more than one element, 0 with ``reduction="mean"``, ``None`` with ``"sum"``, or
            an unknown ``reduction``.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {short_repr(reduction)}: pass "
                         "reduction='mean' for a mean loss, or reduction='sum' with n_items for a summed one")
    summed = reduction == "sum"
    if n_items is None:
        if summed:
            raise ValueError("n_items=None with reduction='sum': a summed loss needs the number of "
                             "items it sums over: pass it, acc.backward(loss, n_items=n, reduction='sum') "
                             "(it may be 0)")
        return None
    if isinstance(n_items, torch.Tensor):
        return _check_tensor(n_items, summed)
    if isinstance(n_items, bool) or not isinstance(n_items, Real):
        raise TypeError(f"n_items must be a number >= 0 or a 0-dim tensor, got {short_repr(n_items)}: "
                        f"{_COUNT_FIX}")
    value: int | float = int(n_items) if isinstance(n_items, Integral) else float(n_items)
    _check_value(value, summed)
    return value


_REAL_DTYPES = frozenset(d for d in vars(torch).values()
                         if isinstance(d, torch.dtype) and not d.is_complex and d != torch.bool)


def _check_tensor(n: torch.Tensor, summed: bool) -> torch.Tensor:
    # This runs on every micro-step of the language-model path: attribute reads only, and no
    # kernel (tolist reads a CPU value without one; a device value is not read at all).
    if n.dtype not in _REAL_DTYPES:
        fix = "the count, mask.sum()" if n.dtype == torch.bool else "an integer or floating count"
        raise TypeError(f"n_items must be a count or a weight, got a {n.dtype} tensor: pass {fix}")
    if n.ndim:
        if n.numel() != 1:
            raise ValueError(f"n_items must be a scalar, got a tensor of shape {tuple(n.shape)}: pass "
                             "the micro-batch's total, e.g. n_items=counts.sum()")
        n = n.reshape(())
    if n.is_meta or n.layout != torch.strided:
        raise ValueError(f"n_items must be a dense tensor with a value, got a {n.layout} tensor on "
                         f"{n.device}: pass the count as a number or a dense CPU or GPU tensor")
    if n.is_cpu:
        _check_value(n.tolist(), summed)  # type: ignore[arg-type]  # an int stays exact
    # No copy: the window's total starts as a wide copy (gradaccum.torch._weights).
    return n.detach() if n.requires_grad else n


def check_total(total: Any) -> None:
    """Raise before a micro-batch's backward if the window's item total (a number or a CPU
    tensor, read without a kernel) leaves the exact range: beyond it the normalization would
    round, and towards float64's limit overflow to non-finite parameters.

    Raises:
        ValueError: the total is above 2**53.
    """
    if isinstance(total, torch.Tensor):
        if total.device.type != "cpu":
            return
        total = total.tolist()
    if total > MAX_EXACT_ITEMS:
        raise ValueError(f"the window's item total {total!r} would pass 2**53, the exact range of the "
                         "float64 normalization: pass smaller counts (e.g. a mean weight per item)")


def _check_value(value: float, summed: bool) -> None:
    if not math.isfinite(value):
        raise ValueError(f"n_items must be finite, got {value}: {_COUNT_FIX}")
    if value > MAX_EXACT_ITEMS:
        raise ValueError(f"n_items={value!r} is beyond float64's exact integer range (2**53): pass "
                         "smaller counts (e.g. a mean weight per item)")
    if value < 0:
        raise ValueError(f"n_items must be >= 0, got {value}: {_COUNT_FIX}")
    if value == 0 and not summed:
        raise ValueError("n_items=0 with reduction='mean': a mean over no items is undefined; for "
                         "micro-batches that may hold no items pass the summed loss with "
                         "reduction='sum'")


def _what(obj: Any) -> str:
    """How an error names a wrong object: the model, its parameters, or the type."""
    if isinstance(obj, torch.nn.Module):
        return f"the model ({type(obj).__name__})"
    if inspect.isgenerator(obj) or (isinstance(obj, (list, tuple)) and obj
                                    and all(isinstance(p, torch.Tensor) for p in obj)):
        return f"parameters (a {type(obj).__name__}, as model.parameters() gives)"
    return type(obj).__name__


def _required_args(obj: Any) -> list[str]:
    """The arguments ``obj.step`` cannot do without, read from its class (an instance's ``step``
    may be wrapped, as LR schedulers wrap the optimizer's)."""
    try:
        params = list(inspect.signature(type(obj).step).parameters.values())[1:]  # without self
    except (AttributeError, TypeError, ValueError):
        return []
    return [p.name for p in params
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def check_parts(optimizer: Any, model: Any, scheduler: Any, scaler: Any) -> None:
    """Check the objects an :class:`~gradaccum.Accumulator` is built from.

    Raises:
        TypeError: an object of the wrong kind; an optimizer whose ``step`` needs a closure
            (LBFGS); a scheduler whose ``step`` needs an argument (ReduceLROnPlateau).
        ValueError: a scheduler bound to another optimizer.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {_what(optimizer)}: build one over "
                        "the model's parameters, e.g. Accumulator(torch.optim.SGD(model.parameters(), "
                        "lr=0.1), steps=4)")
    if _required_args(optimizer):
        raise TypeError(f"optimizer {type(optimizer).__name__} needs a closure in step(closure), which "
                        "re-evaluates the loss, so it cannot step once per accumulated window: use an "
                        "optimizer that steps without one (SGD, Adam, AdamW), or step LBFGS on the whole "
                        "batch yourself, without an Accumulator")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}: pass "
                        "the model you call, model=ddp_model, or leave it out")
    if scheduler is not None:
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler must have a step() method, got {type(scheduler).__name__}: pass "
                            "an LR scheduler, e.g. scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1)")
        needs = _required_args(scheduler)
        if needs:
            raise TypeError(
                f"scheduler {type(scheduler).__name__}.step needs {', '.join(needs)}: leave it out of "
                "the Accumulator and step it yourself when backward() returns True, e.g. "
                "if acc.backward(loss): scheduler.step(metric)")
        bound = getattr(scheduler, "optimizer", optimizer)
        if bound is not optimizer:
            raise ValueError("scheduler is bound to another optimizer than the accumulator's: build it "
                             "over the optimizer you pass to the Accumulator (scheduler = "
                             "StepLR(optimizer, ...); Accumulator(optimizer, steps, scheduler=scheduler))")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}: "
                        "pass scaler=torch.amp.GradScaler(), or leave it out")
