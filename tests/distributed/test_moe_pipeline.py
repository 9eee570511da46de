"""gradaccum.moe under pipeline parallelism (docs/MOE.md, "Pipeline"): MoE layers on every stage,
2 gloo ranks, 1F1B and Interleaved1F1B, each stage's balancing gradient in its own backward.

One launch of tests/distributed/moe_pipeline_ranks.py; each test checks one scenario of it
against one process on the whole window with the whole window's balancing loss written out.
"""

import pytest

from tests.distributed.moe_pipeline_ranks import WINDOWS
from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("tests.distributed.moe_pipeline_ranks", tmp_path_factory.mktemp("moe_pipeline"))


@pytest.mark.parametrize("kind", ["1f1b", "interleaved"])
def test_the_two_passes_by_hand_are_exact_with_a_forward_only_run_of_the_schedule(ranks, kind):
    # the harness itself: the reference and the pre-pass through schedule.eval agree
    for r in scenario(ranks, f"hand {kind}"):
        assert r["diff"] < 1e-12, r["diff"]


@pytest.mark.parametrize("kind", ["1f1b", "interleaved"])
def test_global_balance_under_a_pipeline_equals_one_process_on_the_whole_window(ranks, kind):
    for r in scenario(ranks, f"global {kind}"):
        assert r["diff"] < 1e-12, r["diff"]
        assert r["steps"] == WINDOWS
