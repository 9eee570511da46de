"""The PyTorch adapter: everything that touches tensors."""

from gradaccum.torch.accumulator import Accumulator, MicroBatch

__all__ = ["Accumulator", "MicroBatch"]
