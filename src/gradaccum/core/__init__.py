"""The pure core of gradaccum: window arithmetic, schedules, batch and memory plans, momentum rules,
checkpoint records and validation, shared by both adapters.

May import: no other part of gradaccum

Nothing here imports a framework, so every backend (PyTorch, MindSpore) shares these rules and
they can be tested in microseconds.
"""

from gradaccum.core.checkpoint import FORMAT_VERSION, check_state_record
from gradaccum.core.momentum import scaled_momentum
from gradaccum.core.plan import check_batch_sizes, lr_scale, resolve_batch_sizes, split_sizes
from gradaccum.core.schedule import Schedule, as_schedule, parse_schedule
from gradaccum.core.validate import (
    check_nonneg_int,
    check_optional_positive_float,
    check_positive_float,
    check_positive_int,
)
from gradaccum.core.window import Weighting, Window

__all__ = [
    "FORMAT_VERSION",
    "Schedule",
    "Weighting",
    "Window",
    "as_schedule",
    "check_batch_sizes",
    "check_nonneg_int",
    "check_optional_positive_float",
    "check_positive_float",
    "check_positive_int",
    "check_state_record",
    "lr_scale",
    "parse_schedule",
    "resolve_batch_sizes",
    "scaled_momentum",
    "split_sizes",
]
