"""An :class:`~gradaccum.Accumulator` for a Hugging Face Accelerate loop (docs/INTEGRATIONS.md).

``accelerator.accumulate(model)`` divides each loss by N and weights micro-batches, not tokens.
Replace it with this accumulator and keep the rest of an Accelerate script: the prepared model,
optimizer, scheduler and dataloader, ``if accelerator.sync_gradients:`` after each micro-batch,
``accelerator.save_state`` / ``load_state`` (the partial window included) and
``accelerator.gradient_accumulation_steps`` as the window's length.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gradaccum.integrations._resume import ResumeCheck
from gradaccum.torch import Accumulator as _Accumulator
from gradaccum.torch._guards import stepping_accumulator
from gradaccum.torch._validate import Items, Reduction, Scheduler

__all__ = ["Accumulator"]


class _OwnSteps:
    """Put in place of a prepared scheduler's ``step``: only the accumulator's call steps it.

    After a window's last micro-batch the adapter sets ``accelerator.sync_gradients``, and
    Accelerate's scheduler steps whenever that flag is set: the example's own
    ``lr_scheduler.step()`` left in the loop stepped it a second time per window. Calls from the
    loop are no-ops now, as the prepared optimizer's ``step()`` and ``zero_grad()`` are once the
    boundary has cleared the gradients. Once its accumulator is gone, ``step`` is the scheduler's.
    The accumulator's own call passes: the one an adapter's boundary makes while it steps its
    scheduler (``stepping_accumulator`` names it then).
    """

    def __init__(self, step: Callable[..., Any], owner: Any) -> None:
        self.step = step
        self.owner = weakref.ref(owner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(stepping_accumulator(), Accumulator) or self.owner() is None:
            return self.step(*args, **kwargs)
        return None


def _own_steps(scheduler: Any, owner: Any) -> None:
    """Install (or, for a scheduler a former adapter had, take over) the gate on a prepared
    scheduler's ``step``. A plain torch scheduler keeps its own (its ``state_dict`` would save the
    gate); the accumulator then refuses a step made outside it, at the next window."""
    from accelerate.scheduler import AcceleratedScheduler

    if not isinstance(scheduler, AcceleratedScheduler):
        return
    gate = vars(scheduler).get("step")
    if isinstance(gate, _OwnSteps):
        gate.owner = weakref.ref(owner)
        return
    scheduler.step = _OwnSteps(scheduler.step, owner)


class Accumulator(_Accumulator):
    """A :class:`gradaccum.Accumulator` wired to an ``accelerate.Accelerator``.

    Against a plain accumulator it:

    * takes N from ``accelerator.gradient_accumulation_steps`` unless ``steps`` is given;
    * steps the optimizer inside a prepared one and uses ``accelerator.scaler`` (fp16), so that
      the scaler unscales and steps once per window (a prepared optimizer would step it again);
    * registers itself for checkpointing: ``accelerator.save_state`` keeps the partial window
      and ``load_state`` resumes it bitwise; where the data's order makes that impossible (a
      shuffled dataloader without a seedable sampler, or ``set_epoch`` left out of a resumed
      run) it warns, with the fix;
    * sets ``accelerator.sync_gradients`` after each :meth:`backward` / :meth:`flush` to
      whether that call ended a window (True also when the scaler skipped it, as in Accelerate),
      so ``if accelerator.sync_gradients:`` blocks keep their meaning;
    * flushes the partial window at the last batch of a prepared dataloader, where
      ``accelerator.accumulate`` steps too (the short last window: the mean over what it holds).

    Call ``acc.backward(loss, n_items=...)`` instead of ``accelerator.backward(loss)`` and drop
    ``accelerator.accumulate`` and the ``optimizer.step()``, ``lr_scheduler.step()`` and
    ``optimizer.zero_grad()`` calls: the accumulator makes them once per window. Left in the loop,
    they change nothing: the prepared optimizer's find no gradient after the boundary, and the
    scheduler's ``step`` only passes the accumulator's own call (the adapter puts a gate in place
    of ``scheduler.step``).

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model`` and ``optimizer``.
        optimizer: the prepared optimizer (or a plain ``torch.optim.Optimizer``).
        steps: micro-batches per window; None: ``accelerator.gradient_accumulation_steps``.
        model: the prepared model (DistributedDataParallel under ``accelerate launch``: one
            gradient sync per window, and ``n_items`` summed over the ranks).
        scheduler: the prepared LR scheduler (stepped once per window; Accelerate's wrapper steps
            the schedule once per process, as without accumulation), or None. Its ``step()``
            called from the loop does nothing from then on (the accumulator's passes).
        **options: the other keyword arguments of :class:`gradaccum.Accumulator` (``clip_norm``,
            ``accum_dtype``, ``skip_nonfinite``, ``sync``); not ``scaler``, which is the
            accelerator's.

    Raises:
        TypeError: ``options`` holds ``scaler``, or an argument of the wrong type.
        ValueError: DeepSpeed or Megatron-LM, which accumulate inside their own engine, or an
            argument of the wrong value.

    Example:
        >>> from accelerate import Accelerator
        >>> accelerator = Accelerator(gradient_accumulation_steps=2)
        >>> model = torch.nn.Linear(3, 1)
        >>> model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> acc = Accumulator(accelerator, opt, model=model)
        >>> [acc.backward(model(torch.ones(2, 3)).sum()) for _ in range(3)]
        [False, True, False]
        >>> accelerator.sync_gradients
        False
    """

    def __init__(self, accelerator: Any, optimizer: torch.optim.Optimizer, steps: int | None = None, *,
                 model: torch.nn.Module | None, scheduler: Scheduler | None = None,
                 **options: Any) -> None:
        if "scaler" in options:
            raise TypeError("scaler is the accelerator's (accelerator.scaler); do not pass it")
        engine = str(getattr(accelerator, "distributed_type", ""))
        if engine.endswith(("DEEPSPEED", "MEGATRON_LM")):
            raise ValueError(f"accelerator.distributed_type is {engine}: that engine accumulates "
                             "gradients itself; use its gradient_accumulation_steps")
        inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps it
        raw = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
        super().__init__(raw, accelerator.gradient_accumulation_steps if steps is None else steps,
                         model=model, scheduler=scheduler, scaler=accelerator.scaler, **options)
        self._gradient_state = accelerator.gradient_state
        if scheduler is not None:
            _own_steps(scheduler, self)  # the loop's own scheduler.step() passes no more
        accelerator.register_for_checkpointing(self)
        self._resume = ResumeCheck(accelerator)  # the data's order around save_state / load_state

    def backward(self, loss: torch.Tensor, n_items: Items = None, *, reduction: Reduction = "mean") -> bool:
        """Feed one micro-batch (:meth:`gradaccum.Accumulator.backward`); at the last batch of a
        prepared dataloader, also apply the partial window.

        Returns:
            True when the optimizer stepped during this call.
        """
        return self._fed(lambda: super(Accumulator, self).backward(loss, n_items, reduction=reduction))

    def backward_cached(self, encode: Callable[[Any], Any], loss_fn: Callable[..., torch.Tensor],
                        chunks: Iterable[Any], n_items: Items = None, *, reduction: Reduction = "mean"
                        ) -> bool:
        """Feed one batch of a coupled loss (:meth:`gradaccum.Accumulator.backward_cached`: the
        representations of every chunk and, under ``accelerate launch``, every process); at the
        last batch of a prepared dataloader, also apply the partial window.

        Returns:
            True when the optimizer stepped during this call.

        Example:
            >>> from accelerate import Accelerator
            >>> import gradaccum
            >>> accelerator = Accelerator(gradient_accumulation_steps=1)
            >>> model = torch.nn.Linear(3, 2)
            >>> model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> acc = Accumulator(accelerator, opt, model=model)
            >>> loss_fn = lambda z: torch.nn.functional.cross_entropy(z @ z.T, torch.arange(len(z)))
            >>> acc.backward_cached(model, loss_fn, gradaccum.chunks(torch.randn(6, 3), 2))
            True
        """
        return self._fed(lambda: super(Accumulator, self).backward_cached(encode, loss_fn, chunks, n_items,
                                                                          reduction=reduction))

    def flush(self) -> bool:
        """Apply the partial window now (:meth:`gradaccum.Accumulator.flush`).

        Returns:
            True when the optimizer stepped.
        """
        windows = self.windows
        self._gradient_state.sync_gradients = True
        stepped = super().flush()
        self._gradient_state.sync_gradients = self.windows != windows
        return stepped

    def _fed(self, feed: Callable[[], bool]) -> bool:
        """Run one feeding call with Accelerate's flags around it (``sync_gradients`` True while
        it runs: Accelerate's scheduler steps only then), flushing at the dataloader's end."""
        if self._resume.pending:
            self._resume.check()
        windows = self.windows
        self._gradient_state.sync_gradients = True
        stepped = feed()
        if self.micro_step and self._gradient_state.end_of_dataloader:
            stepped = super().flush()
        self._gradient_state.sync_gradients = self.windows != windows
        return stepped
