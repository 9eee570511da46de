"""backward_cached on 2 gloo ranks (CPU) against one process on the global batch (float64,
1e-12): DDP with the temperature inside the module (with and without find_unused_parameters) or
outside it, ranks holding different numbers of rows, sync='micro_batch', n_items, one gradient
all-reduce per window, refusals raised on every rank, a frozen tower, failures in the second
pass, and FSDP2.

All scenarios run in one launch of tests/distributed/cached_ranks.py.
"""

import pytest

from tests.ranks import run_ranks, scenario

pytestmark = pytest.mark.slow  # several processes: deselected by -m 'not slow'

WINDOWS = 2  # as in cached_ranks.py


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks("tests.distributed.cached_ranks", tmp_path_factory.mktemp("cached"))


def largest(got, want):
    return max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("name", ["ddp", "ddp_find_unused", "ddp_outside", "ddp_uneven", "ddp_micro_batch",
                                  "ddp_frozen"])
def test_ddp_equals_one_process_on_the_global_batch_temperature_included(ranks, name):
    results = scenario(ranks, name)
    for r in results:
        assert largest(r["params"], r["want"]) < 1e-12
        assert abs(r["first_loss"] - r["ref_first_loss"]) < 1e-12  # window_loss: the global loss
    assert largest(results[0]["params"], results[1]["params"]) == 0  # the ranks agree bitwise


@pytest.mark.parametrize("name", ["ddp", "ddp_find_unused", "ddp_outside", "ddp_uneven", "ddp_frozen"])
def test_one_gradient_all_reduce_per_window(ranks, name):
    for r in scenario(ranks, name):
        assert r["calls"] == list(range(1, WINDOWS + 1))  # one bucket, reduced once per window


def test_every_backward_of_sync_micro_batch_is_one_call_not_one_per_chunk(ranks):
    for r in scenario(ranks, "ddp_micro_batch"):
        assert r["calls"] == [2, 4]  # two calls per window, each reducing once


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_n_items_weighs_global_batches_by_their_items(ranks, reduction):
    for r in scenario(ranks, f"n_items_{reduction}"):
        assert largest(r["params"], r["want"]) < 1e-12


def test_refusals_are_raised_on_every_rank_and_change_nothing(ranks):
    results = scenario(ranks, "refusals")
    for r in results:
        assert "from 1 to 3 chunks" in r["counts"]
        assert "differ in number, dtype or shape" in r["per_example"]
        assert r["unchanged"] and r["micro_step"] == 1
    assert "no batch dimension" in results[1]["no_batch_dim"]
    assert "encode on rank 1" in results[0]["no_batch_dim"]
    assert "output 1 of encode for chunk 0 has 1 row(s), its chunk 4 example(s)" in results[1]["rows"]
    assert "encode on rank 1" in results[0]["rows"]


@pytest.mark.parametrize("name", ["failures_ddp", "failures_fsdp", "failures_fsdp_micro_batch"])
def test_a_failed_call_leaves_nothing_or_a_window_refused_until_discard_on_every_rank(ranks, name):
    for r in scenario(ranks, name):
        assert r["first"] == r["later"] == "encode failed"
        assert r["left_nothing"]  # the window's first micro-batch: nothing left, FSDP2's own included
        if name.endswith("micro_batch"):  # the call's gradients were FSDP2's pending ones, dropped
            assert r["refused"] is None
        else:
            assert "partly accumulated" in r["refused"] and "acc.discard()" in r["refused"]
        assert r["steps"] == WINDOWS
        assert largest(r["params"], r["want"]) < 1e-12  # the failures left nothing in the windows


@pytest.mark.parametrize("name", ["fsdp_window", "fsdp_micro_batch"])
def test_fsdp2_equals_one_process_on_the_global_batch(ranks, name):
    for r in scenario(ranks, name):
        assert largest(r["params"], r["want"]) < 1e-12
