"""The contenders do the same training: one window of each gives the hand-written loop's update."""

import pytest
import torch

from gradaccum.bench.config import micro_batches
from gradaccum.bench.loops import LOOPS, accelerate_available, build_loop

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["gradaccum", "accelerate"])
def test_one_window_equals_the_hand_written_loop(name):
    if name == "accelerate" and not accelerate_available():
        pytest.skip("accelerate is not installed")
    batches = micro_batches("mlp", 4, 6, CPU)
    reference, loop = build_loop("hand-written", "mlp", 3, CPU), build_loop(name, "mlp", 3, CPU)
    before = [p.detach().clone() for p in loop.model.parameters()]
    loop.window(batches[:2])  # two of three micro-batches: no step yet
    assert all(torch.equal(p, b) for p, b in zip(loop.model.parameters(), before, strict=True))
    loop.window(batches[2:3])
    for window in (batches[:3], batches[3:]):
        reference.window(window)
    loop.window(batches[3:])
    for p, q in zip(loop.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_unknown_loop_is_refused():
    with pytest.raises(ValueError, match="'dataloader'"):
        build_loop("dataloader", "mlp", 2, CPU)
    assert "seed" in LOOPS
