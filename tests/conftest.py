"""Test-session settings."""

import torch

# The test models are tiny: one thread is faster than two, and it keeps the multi-process tests
# from oversubscribing CI's two cores.
torch.set_num_threads(1)

# The model-based tests (tests/torch/test_window_model.py): CI runs the fixed "ci" profile
# (derandomized: the same sequences every run); "slow" runs 10x as many
# (pytest --hypothesis-profile=slow).
from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = dict(derandomize=True, deadline=None, database=None, print_blob=False,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=200, stateful_step_count=30, **_COMMON)
settings.register_profile("slow", max_examples=2000, stateful_step_count=30, **_COMMON)
settings.load_profile("ci")
