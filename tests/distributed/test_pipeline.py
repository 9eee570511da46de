"""Pipeline parallelism (``Accumulator.backward_pipeline``) on gloo: 2 and 4 processes.

Two launches: tests/distributed/pipeline_ranks.py (2 ranks: every schedule kind, precision,
checkpoints, collectives, bad input, torchtitan's bugs) and pipeline4_ranks.py (4 stages, and
PP x DP 2 x 2 with DDP and FSDP2 stage modules). Each test checks one behaviour of those runs.
"""

import pytest

from tests.distributed.pipeline_ranks import CLIP, STEPS, WINDOWS
from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'

EXACT = ["gpipe sum clip", "gpipe mean", "1f1b sum", "1f1b mean clip", "1f1b plain mean",
         "interleaved sum clip", "interleaved mean", "loopedbfs sum clip", "zero bubble mean clip",
         "interleaved fsdp list sum clip", "interleaved fsdp list micro_batch mean"]
EXACT4 = ["gpipe4 sum clip", "1f1b4 mean", "interleaved4 mean clip", "ppdp ddp 1f1b sum clip",
          "ppdp ddp gpipe mean", "ppdp ddp interleaved sum clip", "ppdp fsdp 1f1b sum clip",
          "ppdp fsdp gpipe mean", "ppdp fsdp interleaved sum clip"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("tests.distributed.pipeline_ranks", tmp_path_factory.mktemp("pipeline"))


@pytest.fixture(scope="module")
def ranks4(tmp_path_factory):
    return run_ranks("tests.distributed.pipeline4_ranks", tmp_path_factory.mktemp("pipeline4"), world=4,
                     timeout=600.0)


def check_exact(results):
    for r in results:
        assert r["diff"] < 1e-12, r["diff"]
        # one optimizer step and one scheduler step per window, on every stage, at its last call
        assert r["stepped"] == ([False] * (STEPS - 1) + [True]) * WINDOWS
        assert r["optimizer_steps"] == WINDOWS and r["lr"] == 0.1 * 0.5 ** WINDOWS
        for got, want in zip(r["losses"], r["ref_losses"], strict=True):
            assert abs(got - want) < 1e-12
    assert all(r["losses"] == results[0]["losses"] for r in results)  # window_loss on every rank


@pytest.mark.parametrize("name", EXACT)
def test_every_stage_equals_one_process_on_the_full_batch(ranks, name):
    # "fsdp list": model=nn.ModuleList of fully_shard stages, as docs/PIPELINE.md says for several
    # stages per rank (before: refused with "call fully_shard(model) on the root too")
    check_exact(scenario(ranks, name))


@pytest.mark.parametrize("name", EXACT4)
def test_four_stages_and_pp_x_dp_equal_one_process_on_the_full_batch(ranks4, name):
    results = scenario(ranks4, name)
    check_exact(results)
    assert all(r["world_size"] == (2 if name.startswith("ppdp") else 1) for r in results)


@pytest.mark.parametrize("name", [n for n in EXACT + EXACT4 if "clip" in n])
def test_clipping_acts_on_the_global_norm_of_every_stage(ranks, ranks4, name):
    results = scenario(ranks if name in EXACT else ranks4, name)
    assert min(results[0]["norms"]) > CLIP  # it clipped every window
    assert all(r["norms"] == results[0]["norms"] for r in results)  # one norm, over every stage


@pytest.mark.parametrize("name", ["scaler inf on stage 0", "skip_nonfinite inf on stage 1"])
def test_an_overflow_on_one_stage_skips_the_window_on_every_stage(ranks, name):
    results = scenario(ranks, name)
    for r in results:
        assert r["unchanged"] and r["skipped"] == 1 and r["steps"] == 2
        assert r["diff"] < 1e-12  # the other two windows, as one process trains them
        assert r["lr"] == 0.1 * 0.5 ** 2  # the scheduler skipped the window too
    assert all(r["scales"] == results[0]["scales"] for r in results)
    if name.startswith("scaler"):
        assert results[0]["scales"] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15]  # backed off once, everywhere


def test_an_overflow_on_one_replica_skips_the_window_on_every_rank(ranks4):
    results = scenario(ranks4, "ppdp ddp scaler inf on rank 2")
    for r in results:
        assert r["unchanged"] and r["skipped"] == 1 and r["steps"] == 2 and r["diff"] < 1e-12
    assert all(r["scales"] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15] for r in results)


def test_flush_applies_a_partial_window_on_every_stage_and_replica(ranks, ranks4):
    results = [*scenario(ranks, "flush"), *scenario(ranks4, "ppdp ddp flush"),
               *scenario(ranks4, "ppdp fsdp flush")]
    for r in results:
        assert r["stepped"] and r["steps"] == 3 and r["micro_step"] == 0 and r["diff"] < 1e-12


def test_discard_drops_a_call_on_every_stage_and_shard(ranks, ranks4):
    for r in scenario(ranks, "discard") + scenario(ranks4, "ppdp fsdp discard"):
        assert r["steps"] == 2 and r["diff"] < 1e-12


def test_accum_dtype_sums_every_pipeline_micro_batch_in_float32(ranks):
    results = scenario(ranks, "accum_dtype")
    # bitwise the one-process accumulator fed the same micro-batches with accum_dtype=float32 ...
    assert all(r["wide"] == 0.0 for r in results)
    # ... which bfloat16 sums inside .grad are not
    assert max(r["narrow"] for r in results) > 0.0


@pytest.mark.parametrize("name", ["checkpoint sum", "checkpoint mean"])
def test_a_checkpoint_mid_window_resumes_bitwise(ranks, name):
    for r in scenario(ranks, name):
        assert r["micro_step_saved"] == 1 and r["bitwise"] and r["loss_bitwise"] and r["steps"] == WINDOWS


def test_a_checkpoint_mid_window_resumes_bitwise_with_fsdp2_stages_under_micro_batch_sync(ranks):
    # Before: the resumed schedule's first step() ran torch's metadata inference and then set
    # .grad = None on every FSDP2 parameter, dropping the restored partial window (6.8e-4 off).
    for r in scenario(ranks, "checkpoint fsdp micro_batch"):
        assert r["micro_step_saved"] == 1 and r["diff"] == 0.0
        assert r["bitwise"] and r["loss_bitwise"] and r["steps"] == WINDOWS


@pytest.mark.parametrize("sync", ["micro_batch", "window"])
def test_a_validation_step_mid_window_keeps_fsdp2_stages_exact(ranks, sync):
    # Before, under "micro_batch": schedule.eval() re-ran the metadata inference, whose cleanup
    # cleared the window's FSDP2 gradients, and the guard dropped the window ("cleared outside").
    for r in scenario(ranks, f"eval fsdp {sync}"):
        assert r["raised"] == "" and r["steps"] == WINDOWS and r["diff"] < 1e-12


@pytest.mark.parametrize("name", ["ppdp ddp checkpoint", "ppdp fsdp checkpoint micro_batch"])
def test_a_checkpoint_mid_window_resumes_bitwise_under_pp_x_dp(ranks4, name):
    for r in scenario(ranks4, name):
        assert r["micro_step_saved"] == 1 and r["bitwise"] and r["loss_bitwise"] and r["diff"] == 0.0


def test_one_small_all_reduce_per_window_plus_one_agreement_at_the_first_call(ranks):
    for r in scenario(ranks, "collectives"):
        calls = [n for n, _ in r["events"]]
        assert calls == [1, 0, 1, 0, 0, 1, 0, 0, 1]  # the first call's agreement, then each boundary
        boundary = {b for (n, b), last in zip(r["events"], [0, 0, 1] * WINDOWS, strict=True) if last}
        assert len(boundary) == 1 and boundary.pop() <= 256  # one small vector of float64


@pytest.mark.parametrize("dp", ["ddp", "fsdp"])
def test_data_parallel_gradients_reduce_once_per_window_not_once_per_step(ranks4, dp):
    last = [False] * (STEPS - 1) + [True]
    for r in scenario(ranks4, f"collectives {dp}"):
        mine, hand = r["gradaccum"], r["schedule"]
        key = "ddp" if dp == "ddp" else "reduce_scatter"
        assert [e[key] for e in mine] == [int(x) for x in last * WINDOWS]
        assert [e["own"] for e in mine] == [1, *[int(x) for x in last * WINDOWS][1:]]
        # the schedule on its own reduces in every step(): N times more
        assert [e[key] for e in hand] == [1] * (STEPS * WINDOWS)


FIRST_CALL = {
    "no_loss_fn": "has no loss_fn",
    "scale_grads": "scale_grads=True",
    "steps_differ": "disagree on steps: from 2 to 3",
    "no_target_first": "target=None",
    "no_items_sum_first": "reduction='sum' needs the items' count",
    "number_with_mean": "n_items=lambda target",
    "items_on_first_stage": "n_items was given on a stage that is not the last",
    "window_differs": "different calls of the window",
}
LATER_CALL = {
    "no_target_later": "target=None",
    "no_items_sum_later": "reduction='sum' needs the items' count",
    "items_on_first_stage_later": "n_items was given on a stage that is not the last",
}


@pytest.mark.parametrize("case", FIRST_CALL)
def test_bad_input_at_the_first_call_raises_on_every_rank_before_any_step(ranks, case):
    for rank, r in enumerate(scenario(ranks, "bad inputs")):
        got = r[case]
        assert FIRST_CALL[case] in got["raised"] and "nothing was run or stepped" in got["raised"]
        assert got["made"] == 0 and got["unchanged"] and got["steps"] == 0
        assert got["micro_step"] == (rank if case == "window_differs" else 0)


@pytest.mark.parametrize("case", LATER_CALL)
def test_bad_input_at_a_later_call_drops_the_window_on_every_rank(ranks, case):
    for r in scenario(ranks, "bad inputs"):
        got = r[case]
        assert LATER_CALL[case] in got["raised"] and "dropped on every rank" in got["raised"]
        assert got["made"] == STEPS - 1  # raised at the window's boundary, its last call
        assert got["unchanged"] and got["steps"] == 0 and got["micro_step"] == 0


def test_a_plain_module_under_two_ranks_is_still_refused_at_its_first_backward(ranks):
    # While torch.distributed.pipelining is imported the refusal waits for the first micro-batch (a
    # stage's module is a plain one); a plain backward() then raises it, before its backward.
    for r in scenario(ranks, "bad inputs"):
        assert "model=Linear while a process group of 2 ranks" in r["plain_module"]
        assert "backward_pipeline" in r["plain_module"] and all(r["plain_module_grads"])


def test_a_refused_call_changes_nothing_and_the_pipeline_trains_on(ranks):
    for r in scenario(ranks, "bad inputs"):
        got = r["trains_after_refusal"]
        assert "target=None" in got["refused"]
        assert got["raised"] == "" and got["made"] == STEPS and got["steps"] == 1


@pytest.mark.parametrize(("case", "what"), [("edited", "changed in place"),
                                           ("edited_flush", "changed in place"),
                                           ("scheduler", "scheduler.step() was called outside")])
def test_a_guard_firing_on_one_rank_drops_the_window_on_every_rank(ranks, case, what):
    # Before: the edit passed silently on 2 ranks (the whole-window check was built for a plain
    # module under 2 ranks, and checked only cleared gradients); the scheduler's and a flush's
    # refusal raised on one rank alone, before the collective the other ranks then waited in.
    results = scenario(ranks, "guard on one rank")
    for rank, r in enumerate(results):
        got = r[case]
        assert "this window was dropped on every rank" in got["raised"], got["raised"]
        mine = (rank == 1) if case.startswith("edited") else (rank == 0)
        assert (what in got["raised"]) == mine  # the rank that saw it names it; the other, its count
        assert ("on 1 rank(s)" in got["raised"]) != mine
        assert got["made"] == STEPS and got["unchanged"] and got["steps"] == 0 and got["micro_step"] == 0
        assert got["next"]["raised"] == "" and got["next"]["steps"] == 1  # the next window trains


def test_a_flush_against_a_call_raises_on_every_rank_with_the_per_call_agreement(ranks):
    for r in scenario(ranks, "uneven calls"):
        assert "others call flush()" in r["raised"] and r["unchanged"] and r["steps"] == 0


def test_a_skipped_call_is_seen_only_at_the_end_and_only_with_the_per_call_agreement(ranks):
    # A stage that skips a batch shifts its data by one; the schedule's point-to-point messages
    # still pair each stage's k-th step(), so every window holds the same calls on every rank (no
    # count at the boundary can differ) and window 1 steps with mispaired batches. The data's end
    # shows it: rank 0's extra call against rank 1's flush(). Without the per-call agreement rank 0
    # waits inside torch's step() for a stage that never comes (gloo's timeout); with it, both raise.
    for r in scenario(ranks, "skipped call"):
        assert "others call flush()" in r["raised"] and "nothing was run or stepped" in r["raised"]
        assert r["made"] == 2 * STEPS - 1 and r["steps"] == 1 and r["micro_step"] == STEPS - 1


def test_replicas_that_call_a_different_number_of_times_raise_at_flush(ranks4):
    for r in scenario(ranks4, "uneven replicas"):
        assert "different calls of the window" in r["raised"] and r["unchanged"] and r["steps"] == 0


def test_torchtitan_bugs_reproduced_and_the_ports_exact(ranks):
    for r in scenario(ranks, "torchtitan bugs"):
        for loop in ("hand", "gradaccum"):
            assert r[f"{loop} clip"] < 1e-12 and r[f"{loop} no clip"] < 1e-12
        # #1733: scale_grads=True rescales the accumulated gradient in every step()
        assert r["titan1733 clip"] > 1e-4 and r["titan1733 no clip"] > 1e-3
        # #2972: the loss divided after backward; clipping that acts hides most of it
        assert r["titan2972 no clip"] > 1e-2
        assert 1e-12 < r["titan2972 clip"] < 1e-5


def test_the_recipes_run_as_printed_and_are_exact(ranks):
    # docs/PIPELINE.md's torchtitan-style loop (correct by hand) and its 8-line gradaccum port
    for r in scenario(ranks, "recipes"):
        assert r["pp-hand"] < 1e-12 and r["pp-gradaccum"] < 1e-12
