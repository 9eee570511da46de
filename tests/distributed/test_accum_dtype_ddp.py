"""accum_dtype under DDP on 2 gloo ranks: the window sums in float32 (float64) buffers, DDP
reduces nothing, and the accumulator averages the wide sums once per window, in their dtype."""

import pytest
import torch

from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("tests.distributed.accum_dtype_ranks", tmp_path_factory.mktemp("accum_dtype"))


def test_float64_sums_of_a_float32_ddp_model_match_one_process(ranks):
    for r in scenario(ranks, "float32_in_float64"):
        assert r["steps"] == 3 and r["flag"] is False  # DDP never reduced a micro-batch
        for got, want in zip(r["params"], r["ref"], strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name, steps", [("bf16_in_float32", 3), ("bf16_flushed", 4)])
def test_bf16_ddp_model_with_float32_sums_keeps_the_ranks_equal_and_matches_one_process(ranks, name, steps):
    both = scenario(ranks, name)
    for a, b in zip(both[0]["params"], both[1]["params"], strict=True):
        assert torch.equal(a, b)
    for r in both:
        assert r["steps"] == steps
        assert r["buffer_bytes"] == r["wide_bytes"]  # one float32 copy of the gradients per rank
        for got, want in zip(r["params"], r["ref"], strict=True):
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)
