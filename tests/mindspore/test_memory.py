"""Resident state: one parameter-sized buffer, where the tutorial's class keeps two."""

import pytest

pytest.importorskip("mindspore.nn", reason="needs MindSpore: pip install 'gradaccum[mindspore]'")

from mindspore import nn

from gradaccum.mindspore import Accumulator
from tests.mindspore_reference import TutorialAccumulator, net, owned_bytes

COUNTERS = 64  # a few scalar Parameters: size, micro-step, items, optimizer steps, norm


def test_one_parameter_sized_buffer_where_the_tutorial_keeps_two():
    model = net()
    param_bytes = sum(p.nbytes for p in model.trainable_params())
    ours = owned_bytes(Accumulator(nn.SGD(model.trainable_params(), 0.1), 2))
    tutorial = owned_bytes(TutorialAccumulator(nn.SGD(model.trainable_params(), 0.1), 2))
    assert param_bytes <= ours <= param_bytes + COUNTERS
    assert 2 * param_bytes <= tutorial <= 2 * param_bytes + COUNTERS
