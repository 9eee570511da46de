"""The whole window's balancing loss under pipeline parallelism (docs/MOE.md, "Pipeline"): MoE
layers on every stage, 2 gloo ranks, 1F1B and Interleaved1F1B, each stage's balancing gradient in
its own backward, by hand (``LoadBalance`` under ``backward_pipeline`` is not there yet).

One launch of tests/distributed/moe_pipeline_ranks.py; each test checks one scenario of it
against one process on the whole window with the whole window's balancing loss written out.
"""

import pytest

from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("tests.distributed.moe_pipeline_ranks", tmp_path_factory.mktemp("moe_pipeline"))


@pytest.mark.parametrize("kind", ["1f1b", "interleaved"])
def test_the_two_passes_by_hand_are_exact_with_a_forward_only_run_of_the_schedule(ranks, kind):
    for r in scenario(ranks, f"hand {kind}"):
        assert r["diff"] < 1e-12, r["diff"]


def test_counting_the_schedules_shape_inference_forwards_is_not_exact(ranks):
    # the negative twin: a hook that counts every forward also counts the extra forward the
    # schedule runs at each switch between eval() and step()
    assert max(r["diff"] for r in scenario(ranks, "hand 1f1b inference counted")) > 1e-4
