"""DDP on 2 gloo ranks: one gradient sync per window, and the same update as one big batch.

All scenarios run in one launch of tests/distributed/ddp_ranks.py (spawning ranks costs
seconds); each test below checks one behaviour of that run.
"""

import pytest
import torch

from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'

STEPS, WINDOWS = 3, 3  # as in ddp_ranks.py


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("tests.distributed.ddp_ranks", tmp_path_factory.mktemp("ddp"))


def assert_all_close(got, want, **tol):
    tol = tol or {"atol": 1e-12, "rtol": 0}
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i: f"tensor {i}: {m}")


def differ(a, b):
    return any(not torch.allclose(x, y) for x, y in zip(a, b, strict=True))


def test_off_boundary_grads_differ_across_ranks_and_boundary_grads_agree(ranks):
    r0, r1 = scenario(ranks, "window")
    assert len(r0["off_grads"]) == WINDOWS * (STEPS - 1)
    for g0, g1 in zip(r0["off_grads"], r1["off_grads"], strict=True):
        assert differ(g0, g1), "off-boundary gradients were synchronized"
    assert len(r0["step_grads"]) == WINDOWS
    for g0, g1 in zip(r0["step_grads"], r1["step_grads"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))


@pytest.mark.parametrize("mode", ["window", "micro_batch", "no_model"])
def test_parameters_equal_one_process_full_batch_after_several_windows(ranks, mode):
    for r in scenario(ranks, mode):
        assert_all_close(r["params"], r["ref_params"])


def test_parameters_bitwise_unchanged_mid_window(ranks):
    assert all(r["unchanged"] for r in scenario(ranks, "window"))


def test_one_gradient_all_reduce_per_window_n_times_fewer_than_every_micro_batch(ranks):
    (window, _), (every, _), (plain, _) = (scenario(ranks, m) for m in ("window", "micro_batch", "no_model"))
    per_sync = window["calls"][STEPS - 1]  # DDP buckets in one sync
    assert per_sync >= 1
    # Off-boundary backwards add no all-reduce; each boundary adds one sync.
    expected = [per_sync * (i // STEPS + (i % STEPS == STEPS - 1)) for i in range(WINDOWS * STEPS)]
    assert window["calls"] == expected
    assert window["bytes"] == WINDOWS * window["grad_bytes"]
    # Without the accumulator's flag (the naive loop) DDP syncs every backward: N times more.
    assert every["calls"][-1] == plain["calls"][-1] == STEPS * window["calls"][-1]
    assert every["bytes"] == plain["bytes"] == STEPS * window["bytes"]


def test_the_all_reduces_of_a_window_and_of_a_flush_are_counted_exactly(ranks):
    # What the pages state: a window costs DDP's gradient all-reduce in its last backward (one
    # call per bucket; one bucket here) plus the accumulator's one small all-reduce at the
    # boundary (the loss sum, 8 bytes; 16 with the item total); a micro-batch before the last
    # costs none. A flush costs no DDP all-reduce, and three of the accumulator's: the ranks'
    # agreement on the window's length, one all-reduce of every gradient (one dtype here), and
    # the small one.
    for r in scenario(ranks, "collectives"):
        events, buckets = r["events"], r["buckets"]
        assert buckets == 1
        full = [e for e in events if e["what"].startswith(("window 0", "window 1", "window 2"))]
        for i, e in enumerate(full):
            last = i % STEPS == STEPS - 1
            weighted = e["what"].startswith("window 2")
            assert (e["ddp"], e["own"]) == ((buckets, 1) if last else (0, 0)), e
            assert e["own_bytes"] == ((16 if weighted else 8) if last else 0), e
        partial, flush = events[3 * STEPS:-1], events[-1]
        assert [(e["ddp"], e["own"]) for e in partial] == [(0, 0), (0, 0)]
        assert (flush["ddp"], flush["own"]) == (0, 3), flush
        # The agreement (a few 8-byte flags and counts), every gradient, the loss sum.
        assert r["grad_bytes"] < flush["own_bytes"] < r["grad_bytes"] + 256


@pytest.mark.parametrize("mode", ["window", "micro_batch"])
def test_window_loss_is_the_global_full_batch_loss(ranks, mode):
    for r in scenario(ranks, mode):
        torch.testing.assert_close(r["losses"], r["ref_losses"], atol=1e-12, rtol=0)


def test_find_unused_parameters_true_is_exact(ranks):
    # pytorch #69031: a parameter used only off-boundary must still be synchronized.
    for r in scenario(ranks, "unused_parameters"):
        assert_all_close(r["params"], r["ref_params"])


def test_uneven_item_counts_across_ranks_are_exact(ranks):
    for r in scenario(ranks, "uneven_items"):
        assert_all_close(r["params"], r["ref_params"])
        torch.testing.assert_close(r["losses"], r["ref_losses"], atol=1e-12, rtol=0)


def test_per_rank_item_normalization_is_not_the_global_mean(ranks):
    # The negative twin: dividing by each rank's own item count misses the reference.
    r = scenario(ranks, "uneven_items")[0]
    assert differ(r["naive_params"], r["ref_params"])


def test_flush_of_a_partial_window_syncs_and_is_exact(ranks):
    for r in scenario(ranks, "flush_partial"):
        # windows of 2 (partial), 4 (full), 3 (partial) micro-batches, an item-weighted partial one,
        # then an empty one: flush steps for the partial ones only.
        assert r["flushed"] == [True, False, True, True, False]
        # Only the full window synced through DDP; flush() reduced the partial ones itself.
        assert r["calls"] == [0, r["calls"][1], r["calls"][1]] and r["calls"][1] >= 1
        assert_all_close(r["params"], r["ref_params"])
        torch.testing.assert_close(r["losses"], r["ref_losses"], atol=1e-12, rtol=0)
    r0, r1 = scenario(ranks, "flush_partial")
    for g0, g1 in zip(r0["step_grads"], r1["step_grads"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))


def test_ranks_flushing_windows_of_different_lengths_all_raise_and_can_discard(ranks):
    r0, r1 = scenario(ranks, "unequal_flush")
    for r in (r0, r1):
        assert "different lengths (from 1 to 2 micro-batches)" in r["message"]
        assert r["optimizer_steps"] == 1
        assert_all_close(r["params"], r["ref_params"])


def test_acceptance_style_backward_only_matches_reference(ranks):
    for r in scenario(ranks, "acceptance"):
        assert r["optimizer_steps"] == 3
        assert_all_close(r["params"], r["ref_params"], atol=1e-5, rtol=1.3e-6)  # float32 defaults
        assert r["world_size"] == 2


def test_batch_size_check_names_all_four_numbers(ranks):
    r = scenario(ranks, "acceptance")[0]
    assert r["batch_error"] == "global batch 64 != micro_batch 4 x steps 2 x world_size 2 (= 16)"


def test_a_rank_that_raises_mid_window_does_not_hang_the_other(ranks):
    r0, r1 = scenario(ranks, "stalled_peer")
    assert r1["outcome"] == "raised: a bad batch on rank 1"
    # Rank 0's boundary all-reduce gives up after its process group's timeout (3 s here, against
    # 60 s for the default group): gloo's message names it, so no clock is read.
    assert "Timed out waiting 3000ms" in r0["outcome"], r0["outcome"]


def test_every_gradient_is_checked_once_per_window_and_ddp_reductions_are_not_taken_for_an_edit(ranks):
    # Sync "window": no reduction before the last micro-batch, the check is exact; "micro_batch":
    # each reduction rewrites .grad (a bucket view replaces it), only a cleared gradient is seen.
    for r in scenario(ranks, "grad_guards"):
        for key, value in r.items():
            if key.endswith("params"):
                assert_all_close(*value)
            else:
                what = "changed in place" if key.startswith("window") else "cleared"
                assert value.startswith(f"the gradient of parameter 'module.head.bias' was {what}"), value
