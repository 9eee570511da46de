"""The Lightning mixin's 0.3.0 path, kept so that code written for it still imports.

The mixin lives in the integrations room, :mod:`gradaccum.integrations.lightning`
(docs/LIGHTNING.md); the names here are the same objects. Like it, this module imports no
Lightning.
"""

from gradaccum.integrations.lightning import CHECKPOINT_KEY, AccumulatorMixin

__all__ = ["CHECKPOINT_KEY", "AccumulatorMixin"]
