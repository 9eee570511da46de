"""What the mixin tells a user who wired it wrong: the bases in the wrong order (a TypeError when
the class is defined), and an epoch that trained nothing because ``training_step`` never called
``self.accumulate`` (a warning, once)."""

from __future__ import annotations

import warnings

import torch

__all__ = ["check_base_order", "warn_if_nothing_fed"]


def check_base_order(cls: type, mixin: type) -> None:
    """Refuse a module class that lists a LightningModule before the mixin among its bases.

    There the LightningModule's ``__init__`` gets ``steps=`` (and refuses it), and its hooks
    (``backward``, ``on_train_start``, ...) come before the mixin's, which would never run.

    Raises:
        TypeError: ``torch.nn.Module`` comes before ``mixin`` in ``cls``'s MRO.
    """
    mro = cls.__mro__
    if torch.nn.Module not in mro or mro.index(torch.nn.Module) > mro.index(mixin):
        return
    bases = [b.__name__ for b in cls.__bases__]
    first = [b.__name__ for b in cls.__bases__ if issubclass(b, torch.nn.Module)
             and not issubclass(b, mixin)][:1] or ["LightningModule"]
    right = [mixin.__name__] + [b for b in bases if b != mixin.__name__]
    raise TypeError(f"class {cls.__name__}({', '.join(bases)}) lists {first[0]} before "
                    f"{mixin.__name__}: put the mixin first among the bases, class {cls.__name__}"
                    f"({', '.join(right)}), so that its __init__ takes steps= and its hooks run")


def warn_if_nothing_fed(module: object, epoch: int, batches: int, fed: int) -> bool:
    """Warn when an epoch ran ``training_step`` but fed no micro-batch to the accumulator.

    Args:
        module: the LightningModule (named in the message).
        epoch: the epoch that ended (0-based, as Lightning counts).
        batches: the ``training_step`` calls of the epoch.
        fed: the ``accumulate`` calls of the epoch.

    Returns:
        Whether it warned.
    """
    if batches == 0 or fed > 0:
        return False
    warnings.warn(f"{type(module).__name__}: epoch {epoch} ran training_step {batches} time(s) "
                  "without a call to self.accumulate(loss), so nothing trained (no optimizer step, "
                  "global_step unchanged): call self.accumulate(loss) in training_step, in place "
                  "of loss.backward() or self.manual_backward(loss)", UserWarning, stacklevel=2)
    return True
