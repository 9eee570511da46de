"""Test-session settings."""

import torch

# The test models are tiny: one thread is faster than two, and it keeps the multi-process tests
# from oversubscribing CI's two cores.
torch.set_num_threads(1)
