"""The whole window's balancing loss under pipeline parallelism (docs/MOE.md, "Pipeline"): MoE
layers on every stage, 2 gloo ranks, 1F1B and Interleaved1F1B, each stage's balancing gradient in
its own backward: ``LoadBalance`` under ``backward_pipeline`` in the one-pass modes (per pipeline
micro-batch), what it refuses there, and the exact two passes by hand.

One launch of tests/distributed/moe_pipeline_ranks.py; each test checks one scenario of it
against one process on the whole window with the balancing loss written out.
"""

import pytest

from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("tests.distributed.moe_pipeline_ranks", tmp_path_factory.mktemp("moe_pipeline"))


@pytest.mark.parametrize("name", ["1f1b rolling", "1f1b micro_batch", "interleaved rolling",
                                  "interleaved micro_batch", "gpipe rolling", "zb rolling",
                                  "1f1b rolling checkpoint"])
def test_load_balance_under_backward_pipeline_is_exact_per_pipeline_micro_batch(ranks, name):
    # zb: ScheduleInterleavedZeroBubble (the input and weight backwards split); checkpoint: each
    # MoE layer under non-reentrant activation checkpointing (the router recomputed in the backward)
    for r in scenario(ranks, f"balance {name}"):
        assert r["diff"] < 1e-12, r["diff"]
        assert r["steps"] == 3
        # the twins: the mode's own objective, not the other mode's, the whole window's or none
        assert min(r["from_other"], r["from_global"], r["from_none"]) > 1e-6, r


@pytest.mark.parametrize("name", ["rolling mean", "rolling short", "micro_batch mean short"])
def test_load_balance_under_backward_pipeline_is_exact_with_a_mean_or_a_short_window(ranks, name):
    # mean: no n_items, every pipeline micro-batch's token mean weighs alike; short: the last
    # window one call short, flushed by windows() (the boundary's N / calls undone)
    for r in scenario(ranks, f"balance 1f1b {name}"):
        assert r["diff"] < 1e-12, r["diff"]
        assert min(r["from_other"], r["from_none"]) > 1e-6, r


def test_the_recipe_of_moe_md_runs_as_printed_and_is_exact(ranks):
    # docs/MOE.md's "moe-pipeline" recipe, on 2 ranks, against one process ("rolling")
    for r in scenario(ranks, "recipe"):
        assert r["diff"] < 1e-12 and r["steps"] == 3, r


def test_the_window_load_is_each_stages_routes(ranks):
    # the top-k routes of every valid token of the window, per layer of this rank's stage(s): the
    # schedule's metadata-inference forward is not counted
    for kind in ("1f1b", "interleaved"):
        for r in scenario(ranks, f"balance {kind} rolling"):
            assert r["loads"] == r["expected_loads"] and len(r["loads"]) == 3, r


@pytest.mark.parametrize("what, match", [("global", "use mode='rolling'"),
                                         ("pooled", "use per_layer=True")])
def test_what_is_not_supported_is_refused_on_every_rank_before_anything_changes(ranks, what, match):
    for r in scenario(ranks, f"refused {what}"):
        assert r["refusal"] is not None and match in r["refusal"], r["refusal"]
        assert r["unchanged"]
        assert r["steps"] == 1  # the twin: without the balance the same loop trains


@pytest.mark.parametrize("kind", ["1f1b", "interleaved"])
def test_the_two_passes_by_hand_are_exact_with_a_forward_only_run_of_the_schedule(ranks, kind):
    for r in scenario(ranks, f"hand {kind}"):
        assert r["diff"] < 1e-12, r["diff"]


def test_counting_the_schedules_shape_inference_forwards_is_not_exact(ranks):
    # the negative twin: a hook that counts every forward also counts the extra forward the
    # schedule runs at each switch between eval() and step()
    assert max(r["diff"] for r in scenario(ranks, "hand 1f1b inference counted")) > 1e-4
