"""The PyTorch adapter: everything that touches tensors."""

from gradaccum.torch.accumulator import Accumulator, MicroBatch
from gradaccum.torch.checker import CheckReport, TensorDiff, check_equivalence
from gradaccum.torch.hazards import Hazard

__all__ = ["Accumulator", "CheckReport", "Hazard", "MicroBatch", "TensorDiff", "check_equivalence"]
