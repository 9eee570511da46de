"""gradaccum inside a Lightning module: :class:`AccumulatorMixin` (docs/LIGHTNING.md). Its 0.3.0
path, ``gradaccum.lightning``, still imports the same objects.

Lightning's own ``accumulate_grad_batches`` divides every loss by N (the short last window too)
and weights micro-batches, not tokens. The mixin turns a LightningModule into one that feeds
each micro-batch to a :class:`gradaccum.Accumulator` and steps once per window, exactly:

* **DDP** (``strategy="ddp"``): every backward goes through ``manual_backward`` (so Lightning's
  strategy arms DDP's reducer and runs the precision plugin's and callbacks' backward hooks);
  off-boundary micro-batches run under ``strategy.block_backward_sync()``: one gradient
  all-reduce per window.
* **Precision plugins**: the accumulator gets the plugin's ``GradScaler`` (``"16-mixed"``) and
  steps the raw optimizer itself, so the plugin never unscales or steps a second time.
* **Schedulers** from ``configure_optimizers``: unwrapped and stepped per window
  (``interval="step"``) or per epoch (``"epoch"``).
* **Validation** in the middle of a window keeps the partial window (Lightning's default
  ``on_validation_model_zero_grad`` would clear it).
* **Checkpoints** hold the accumulator's state (every rank's under DDP): a mid-window resume is
  bitwise.
* **global_step** counts windows (one per optimizer step, a flushed last window included).
* **Misuse** is named: the mixin listed after the LightningModule is a TypeError where the class
  is defined; an epoch whose ``training_step`` never called ``accumulate`` warns once.

Lightning is not imported here: the mixin uses only the objects the trainer hands it, so it
works with ``pytorch_lightning`` and ``lightning.pytorch`` alike, and ``import gradaccum`` never
loads either.
May import: gradaccum.core, gradaccum.torch
"""

from gradaccum.integrations.lightning._checkpoint import CHECKPOINT_KEY
from gradaccum.integrations.lightning.mixin import AccumulatorMixin

__all__ = ["CHECKPOINT_KEY", "AccumulatorMixin"]
